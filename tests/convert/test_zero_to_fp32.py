"""The one path to Hugging Face also takes what DeepSpeed's own `zero_to_fp32.py` writes, and the
checkpoints folder says how to convert (`checkpoints/README.md`).

The helper DeepSpeed copies beside the checkpoints is run as a user would (a subprocess, from the
checkpoints directory), in its default, sharded and (if it gets through the tied embeddings)
safetensors forms; `cpt-convert TAG OUT --weights ITS_OUTPUT` must give the very tensors of the
direct conversion, for every ZeRO stage (stage 0 writes no partitions for zero_to_fp32 to read).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.export.convert import main as convert_main
from tests.convert.conftest import RUNS

pytestmark = pytest.mark.slow
ZERO_RUNS = [name for name, spec in RUNS.items() if spec.zero_stage > 0]


def zero_to_fp32(checkpoints: Path, tag: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(out), "-t", tag, *flags], cwd=checkpoints,
                          env=env, capture_output=True, text=True, timeout=300)


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("name", ZERO_RUNS)
def test_cpt_convert_takes_zero_to_fp32_output(name, trained_runs, converted, tmp_path):
    run = trained_runs(name)
    tag = run.tag_dir
    direct = hf_tensors(converted(name))
    outputs = {"bin": tmp_path / "z_bin", "sharded": tmp_path / "z_sharded"}
    for form, flags in (("bin", ()), ("sharded", ("--max_shard_size", "100KB"))):
        proc = zero_to_fp32(run.checkpoints, tag.name, outputs[form], *flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(outputs["sharded"].glob("pytorch_model-*.bin"))) > 1  # really sharded
    # what safetensors' own save_model writes for a model with tied weights: one name per storage
    state = torch.load(outputs["bin"] / "pytorch_model.bin", weights_only=True)
    assert "cls.predictions.decoder.weight" in state and "attention.self.qkv" in " ".join(state)  # not HF names
    outputs["safetensors"] = tmp_path / "z_safetensors"
    outputs["safetensors"].mkdir()
    save_file({k: v.contiguous() for k, v in state.items() if k != "cls.predictions.decoder.weight"},
              str(outputs["safetensors"] / "model.safetensors"))
    safe = tmp_path / "z_safe_serialization"
    if zero_to_fp32(run.checkpoints, tag.name, safe, "--safe_serialization").returncode == 0:
        outputs["safe_serialization"] = safe  # a DeepSpeed that gets through the tied embeddings
    for form, weights in outputs.items():
        out = tmp_path / f"hf_{form}"
        assert convert_main([str(tag), str(out), "--weights", str(weights)]) == 0, form
        got = hf_tensors(out)
        assert got.keys() == direct.keys(), form
        for key in direct:
            assert torch.equal(got[key], direct[key]), (form, key)
        assert "zero_to_fp32.py" in (out / "README.md").read_text()  # the card says where the weights came from


def test_zero_to_fp32_output_alone_gets_the_way_to_convert_it(trained_runs, tmp_path, capsys):
    run = trained_runs("zero3-1rank-mlmnce")
    weights = tmp_path / "z"
    assert zero_to_fp32(run.checkpoints, run.tag_dir.name, weights).returncode == 0
    assert convert_main([str(weights), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "written by DeepSpeed's zero_to_fp32.py" in err and f"--weights {weights}" in err
    assert not (tmp_path / "hf").exists()
    assert convert_main([str(run.tag_dir), str(tmp_path / "hf"), "--weights", str(tmp_path)]) == 2
    assert "pass the output directory of zero_to_fp32.py" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["zero0-1rank-mlm", "zero3-1rank-mlmnce"])
def test_checkpoints_folder_says_how_to_convert(name, trained_runs, tmp_path):
    """The README beside the checkpoints names the command, and that command works as written."""
    run = trained_runs(name)
    readme = (run.checkpoints / "README.md").read_text()
    assert "zero_to_fp32.py" in readme and "--weights" in readme
    commands = [line.strip() for line in readme.splitlines() if line.strip().startswith("cpt-convert")]
    first = shlex.split(commands[0].split("#")[0])
    assert first[1] == str(run.output_dir.resolve())
    assert convert_main([first[1], str(tmp_path / first[2])]) == 0
    assert (tmp_path / "hf_model" / "model.safetensors").is_file()
