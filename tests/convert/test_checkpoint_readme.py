"""The README written beside every run's checkpoints (`checkpoints/README.md`) names the run's own family
(`model.arch`) and the Hugging Face class its checkpoints convert to, and its command, run as written,
gives that class (a ModernBERT run's README once promised a `BertForMaskedLM`)."""
from __future__ import annotations

import json
import shlex

import pytest

from pipeline.export.convert import main as convert_main
from tests.train.runs import run_inprocess


@pytest.mark.parametrize("arch, hf_class, other_class", [("bert", "BertForMaskedLM", "ModernBert"),
                                                         ("modernbert", "ModernBertForMaskedLM", "`BertForMaskedLM`")])
def test_checkpoints_readme_names_the_family_and_its_class(arch, hf_class, other_class, tiny_shards_dir, tmp_path):
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, f"model.arch={arch}", "train.total_steps=1",
                         "train.checkpoint_every=1") == 0
    readme = (out / "checkpoints" / "README.md").read_text()
    assert f"(`model.arch={arch}`)" in readme.splitlines()[0]
    assert f"Hugging Face `{hf_class}` directory" in readme and other_class not in readme

    command = next(line.strip() for line in readme.splitlines() if line.strip().startswith("cpt-convert"))
    _, run_dir, out_name = shlex.split(command.split("#")[0])
    assert run_dir == str(out.resolve())
    assert convert_main([run_dir, str(tmp_path / out_name)]) == 0
    assert json.loads((tmp_path / out_name / "config.json").read_text())["architectures"] == [hf_class]
