"""The shared tail of the evaluation commands (`cpt-finetune`, `cpt-sts`): run the measurement with torch's
CPU thread count as asked, print its JSON result (or a person's rendering of it), and write the JSON
atomically where `--out`/`--output` says; an
expected failure (bad input, found before any compute) is one line on stderr and exit code 2."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline.io import write_atomic


def run_json_command(compute: Callable[[], dict], threads: int, output: Optional[str],
                     errors: tuple[type[BaseException], ...] = (ValueError,),
                     render: Optional[Callable[[dict], str]] = None) -> int:
    """`compute()` under `threads` torch threads (0: torch's default; small models on a shared CPU can be far
    slower with more), its result printed as JSON (or as `render(result)`, text for a person) and written to
    `output` as JSON (atomically) when given. Exit code 0, or 2 with `error: <message>` for an exception of
    `errors`; the thread count is restored either way."""
    previous_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        result = compute()
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(previous_threads)
    text = json.dumps(result, indent=2)
    if output:
        write_atomic(Path(output), text + "\n", shared=True, parents=True)
    print(text if render is None else render(result))
    return 0
