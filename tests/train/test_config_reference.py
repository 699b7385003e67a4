"""The configuration reference (docs/configuration.md) is generated from the config classes and is current:
no config field ships without its docstring or missing from the page (issue 58)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.config.reference import END, START, StaleReference, as_override, markdown_reference, render_into, undocumented
from pipeline.train import config_reference
from pipeline.train.run_config import RunConfig, describe_run_config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_page_is_current():
    text, current = config_reference.current_page(PAGE)
    assert text == current, "docs/configuration.md is not current: python -m pipeline.train.config_reference"
    assert config_reference.main(["--check", str(PAGE)]) == 0


def test_every_field_has_a_docstring_and_a_row():
    assert undocumented(RunConfig) == []
    text = PAGE.read_text()
    for line in describe_run_config().splitlines():  # --help-config's fields, the same source
        if not line.startswith(" "):
            name = line.split(" = ")[0]
            assert f"| `{name}` |" in text, name
    for newest in ("model.activation_checkpointing", "train.profile.start", "train.profile.steps", "eval.shards_dir"):
        assert f"| `{newest}` |" in text


@dataclass
class _Inner:
    depth: int = 3
    """How deep | how far."""


@dataclass
class _Root:
    name: str = "x"
    """The name."""
    inner: _Inner = field(default_factory=_Inner)
    betas: tuple = (0.9, 0.98)
    """Two betas."""
    undocumented_field: bool = False


def test_rendering_sections_defaults_and_undocumented_fields():
    text = markdown_reference(_Root)
    assert "| `name` | `x` | The name. |" in text and "| `inner.depth` | `3` | How deep \\| how far. |" in text
    assert "| `betas` | `[0.9, 0.98]` | Two betas. |" in text  # as an override takes it
    assert text.index("### Top level") < text.index("### `inner`")
    assert undocumented(_Root) == ["undocumented_field"]
    assert [as_override(v) for v in (None, True, "", "zero", {}, {"mlm": 1.0})] == ["null", "true", "''", "zero", "{}",
                                                                                     "{mlm: 1.0}"]


def test_regeneration_replaces_only_the_region_and_refuses_a_page_without_markers(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text(f"intro\n{START}\n| `stale.field` | 1 | gone |\n{END}\nafter\n")
    assert config_reference.main(["--check", str(page)]) == 1
    assert "not current" in capsys.readouterr().err and "stale.field" in page.read_text()  # --check writes nothing
    assert config_reference.main([str(page)]) == 0
    new = page.read_text()
    assert new.startswith(f"intro\n{START}\n") and new.endswith(f"{END}\nafter\n") and "stale.field" not in new
    assert "| `model.activation_checkpointing` |" in new and config_reference.main(["--check", str(page)]) == 0
    with pytest.raises(StaleReference, match="needs exactly one"):
        render_into("no markers\n", _Root, where="other.md")


def test_a_field_without_a_docstring_fails_the_check(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(config_reference, "RunConfig", _Root)  # a config class with one undocumented field
    page = tmp_path / "configuration.md"
    page.write_text(f"{START}\n{END}\n")
    assert config_reference.main([str(page)]) == 1
    assert "config fields without a docstring: undocumented_field" in capsys.readouterr().err
    assert page.read_text() == f"{START}\n{END}\n"
