"""The documentation as a reader meets it (issue 58): the README stays a front door (short, its two
commands real), every relative link in the README and the docs leads to a file and heading that exist,
and docs/training.md's contents list names every section of the page."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
#: The README's generated GPU table (benchmarks.gpu_suite.collect) is left out of its length.
GPU_TABLE = re.compile(r"<!-- gpu-suite:table:start.*?<!-- gpu-suite:table:end -->\n", re.DOTALL)
#: 250 lines in all (nanoGPT's and torchtitan's READMEs are about that long), 15 of them for the GPU table.
MAX_README_LINES = 235
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """`text` without its fenced code blocks (a `[i](x)` inside code is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(page.read_text()), re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    return broken


def test_slugs_follow_github():
    assert slug("Trackers: Weights & Biases, MLflow, TensorBoard") == "trackers-weights--biases-mlflow-tensorboard"
    assert slug("How is a run doing? `cpt-status`") == "how-is-a-run-doing-cpt-status"
    assert slug("### `model` (`pipeline.model.config.ModelConfig`)".lstrip("# ")) == "model-pipelinemodelconfigmodelconfig"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section) [gone](missing.md) [typo](other.md#a-sectoin)\n"
                    "```\nheads[\"capt\"](cls_states)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#a-sectoin (no such heading)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(GPU_TABLE.findall(text)) == 1, "the README keeps the GPU table's markers"
    lines = GPU_TABLE.sub("", text).splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md: {len(lines)} lines outside the GPU table (at most {MAX_README_LINES})"
    for section in ("## Quickstart: two commands", "## Objectives", "## Results", "## Tests", "## Documentation"):
        assert section in text


def test_the_readmes_two_commands_are_real():
    """The quickstart block runs the demo and the tests through the scripts that exist, with options they take."""
    from demo.run import demo_objectives

    block = prose_blocks(README.read_text())[0]
    commands = [shlex.split(line.split("#")[0]) for line in block if not line.startswith("export ")]
    assert [c[:2] for c in commands] == [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]]
    assert all((ROOT / c[1]).is_file() for c in commands)
    demo = commands[0]
    assert demo[2] == "--objective" and demo[3] in demo_objectives()
    assert 'TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"' in block[0]
    assert "TORCH_PIP_ARGS" in (ROOT / "scripts" / "venv.sh").read_text()


def prose_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced code block, in order."""
    return [block.strip("\n").splitlines() for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE)]


def test_the_training_contents_name_every_section():
    page = ROOT / "docs" / "training.md"
    text = page.read_text()
    contents = text[: text.index("\n## ")]
    for heading in re.findall(r"^## (.+)$", prose(text), re.MULTILINE):
        assert f"](#{slug(heading)})" in contents, f"docs/training.md's contents miss '{heading}'"
