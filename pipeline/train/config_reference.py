"""`python -m pipeline.train.config_reference [--check] [PAGE]`: regenerate the configuration reference.

Renders every field of `RunConfig` (defaults and docstrings, the source of `--help-config`) into the
marker region of `docs/configuration.md` (`pipeline.config.reference`), written atomically. `--check`
writes nothing and exits 1, naming the page and this command, when the page is not current (what
`tests/train/test_config_reference.py` asserts, so no field ships undocumented).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from pipeline.config.reference import StaleReference, render_into, undocumented
from pipeline.io import write_atomic
from pipeline.train.run_config import RunConfig

#: The page in a source checkout (the reference documents the checkout it is generated from).
PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "python -m pipeline.train.config_reference"


def current_page(page: Path) -> tuple[str, str]:
    """(the page as it is, the page as it should be): the second raises `StaleReference` for a page
    without its marker region, or for a config field that has no docstring."""
    text = page.read_text()
    missing = undocumented(RunConfig)
    if missing:
        raise StaleReference(f"config fields without a docstring: {', '.join(missing)}; write one under each "
                             "field in its config class, then run " + COMMAND)
    return text, render_into(text, RunConfig, where=str(page))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("page", nargs="?", type=Path, default=PAGE, help=f"the Markdown page (default: {PAGE})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is not current")
    args = parser.parse_args(argv)
    try:
        text, new = current_page(args.page)
    except (StaleReference, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if new == text:
        print(f"{args.page}: current")
        return 0
    if args.check:
        print(f"error: {args.page}: the configuration reference is not current (a config field was added, removed "
              f"or re-documented); regenerate it: {COMMAND}", file=sys.stderr)
        return 1
    write_atomic(args.page, new)
    print(f"{args.page}: regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
