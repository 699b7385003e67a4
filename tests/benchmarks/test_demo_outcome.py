"""The demo explains itself: every set-up phase announces itself, the README installs the test tools
before its test command, and the outcome stage tells a working run from a broken one on held-out
text (with TACO's leak checks)."""
from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from demo.corpus import MIN_WORDS, write_corpus
from demo.outcome import last_validation, measure, report_lines, validation_numbers, verdict

REPO = Path(__file__).resolve().parents[2]


def test_every_pip_install_of_the_scripts_is_announced_and_timed():
    seen = 0
    for script in ("demo.sh", "test.sh", "venv.sh"):
        lines = [line.strip() for line in (REPO / "scripts" / script).read_text().splitlines()]
        code = [line for line in lines if line and not line.startswith("#")]
        installs = [i for i, line in enumerate(code) if "pip install" in line and not line.startswith(("phase", "echo"))]
        for i in installs:
            assert code[i - 1].startswith("phase "), f"{script}: silent install: {code[i]}"
            assert code[i + 1] == "took", f"{script}: untimed install: {code[i]}"
            assert code[i].startswith('"$PYTHON" -m pip'), f"{script}: not the virtual environment's pip: {code[i]}"
        seen += len(installs)
    assert seen == 3  # torch (venv.sh), the package (demo.sh), the package with its test tools (test.sh)


def _source_venv(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run(["bash", "-c", 'set -euo pipefail; source scripts/venv.sh; cpt_python; echo "PYTHON=$PYTHON"'],
                          cwd=REPO, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                         "CPT_BASE_PYTHON": sys.executable, **env},
                          capture_output=True, text=True, timeout=300)


def test_scripts_create_and_reuse_a_virtual_environment_not_the_machines_python(tmp_path):
    """The README's commands never pip-install into whatever python3 is (PEP 668): scripts/venv.sh creates
    CPT_VENV with `python -m venv` (pip inside), reuses it, refuses a directory that is something else."""
    venv_dir = tmp_path / "env"
    first = _source_venv(tmp_path, {"CPT_VENV": str(venv_dir)})
    assert first.returncode == 0, first.stderr
    assert "creating the virtual environment" in first.stdout and f"PYTHON={venv_dir}/bin/python" in first.stdout
    assert (venv_dir / "pyvenv.cfg").is_file()
    probe = subprocess.run([str(venv_dir / "bin" / "python"), "-c", "import sys; print(sys.prefix != sys.base_prefix)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "True"
    again = _source_venv(tmp_path, {"CPT_VENV": str(venv_dir)})
    assert again.returncode == 0 and "using the virtual environment" in again.stdout and "creating" not in again.stdout
    other = tmp_path / "thesis"
    other.mkdir()
    (other / "chapter1.tex").write_text("precious")
    refused = _source_venv(tmp_path, {"CPT_VENV": str(other)})
    assert refused.returncode == 1 and "is not a virtual environment" in refused.stderr
    assert (other / "chapter1.tex").read_text() == "precious"
    own = _source_venv(tmp_path, {"PYTHON": "/usr/bin/python3"})
    assert own.returncode == 0 and "PYTHON=/usr/bin/python3" in own.stdout and "no virtual environment" in own.stdout


def test_demo_script_says_what_it_runs(tmp_path):
    proc = subprocess.run(["bash", "scripts/demo.sh", "--objective", "nope", "--out", str(tmp_path / "o")],
                          cwd=REPO, env={"PATH": "/usr/bin:/bin:" + str(Path(__import__("sys").executable).parent),
                                         "DEMO_SKIP_INSTALL": "1", "PYTHONPATH": str(REPO), "HOME": str(tmp_path),
                                         "PYTHON": __import__("sys").executable},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "== [setup] DEMO_SKIP_INSTALL=1" in proc.stdout and "== [setup] starting the demo" in proc.stdout


def test_readme_installs_the_test_tools_before_its_test_command():
    readme = (REPO / "README.md").read_text()
    tests = readme[readme.index("## Tests"):]
    assert tests.index('pip install -e ".[dev]"') < tests.index("python -m pytest")
    extras = (REPO / "setup.cfg").read_text()
    assert re.search(r"^dev =\n(    .+\n)*    pytest", extras, re.MULTILINE)
    script = (REPO / "scripts" / "test.sh").read_text()
    assert script.index('pip install -q -e ".[dev]"') < script.index("-m pytest")


def _letters(number: int) -> str:
    return "".join(chr(ord("a") + int(d)) for d in str(number))  # prose filter: words of letters


def _paragraph(doc: int, para: int) -> str:
    return " ".join(f"w{_letters(doc)}x{_letters(para)}y{_letters(k)}" for k in range(MIN_WORDS + 2)) + "."


def test_the_corpus_under_its_cap_is_written_whole_and_deterministically(tmp_path):
    """The corpus stage holds nothing out (the shards stage does, by document: `data_prep.holdout`)."""
    sources = [("user-text", "\n\n".join(_paragraph(d, p) for p in range(3))) for d in range(45)]
    total = sum(len(("\n".join(_paragraph(d, p) for p in range(3)) + "\n\n").encode()) for d in range(45))
    train = write_corpus(sources, tmp_path / "train.txt", max_bytes=total)
    assert (train.documents, train.paragraphs, train.bytes) == (45, 135, total)
    again = write_corpus(sources, tmp_path / "train2.txt", max_bytes=total)
    assert (tmp_path / "train2.txt").read_text() == (tmp_path / "train.txt").read_text() and again.bytes == total
    capped = write_corpus(sources, tmp_path / "capped.txt", max_bytes=total - 1)
    assert capped.documents == 44  # the cap drops whole documents


@pytest.fixture(scope="module")
def random_bert(tiny_shards_dir, tmp_path_factory) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    from pipeline.data.shards import read_manifest

    manifest = read_manifest(tiny_shards_dir)
    torch.manual_seed(3)
    config = BertConfig(vocab_size=manifest.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=manifest.seq_len)
    out = tmp_path_factory.mktemp("random_bert")
    BertForMaskedLM(config).save_pretrained(str(out))
    return out


def val_record(step: int, accuracy: float, plateau: float = 0.2, loss: float = 3.0, cosine: float = 0.4) -> dict:
    return {"step": step, "val/loss": loss, "val/mlm_head/accuracy": accuracy, "val/mlm_head/loss": loss,
            "val/health/unigram_accuracy": plateau, "val/health/token_cosine": cosine}


def test_outcome_measures_both_models_and_finds_no_taco_leak(random_bert, tiny_shards_dir):
    result = measure(random_bert, tiny_shards_dir, rows=64)
    for name in ("trained", "random_init"):
        r = result[name]
        assert r["taco_anchors"] > 1000 and "mlm_acc" not in r  # the masked-LM numbers are validation's
        assert (r["leak_positive_is_anchor"], r["leak_positive_other_document"], r["leak_negative_same_document"]) == (0, 0, 0)
        assert math.isfinite(r["taco_loss"]) and math.isfinite(r["taco_loss_random_tokens"])
    # the verdict reads validation's numbers: at the plateau is a broken run, above it and the init a working one
    result["trained"].update(validation_numbers(val_record(100, accuracy=0.2), "trained"))
    result["random_init"].update(validation_numbers(val_record(0, accuracy=0.2, loss=5.0), "init"))
    assert verdict(result).startswith("NOT working")
    assert any("leak checks (must be 0)" in line for line in report_lines(result))
    result["trained"].update(validation_numbers(val_record(100, accuracy=0.31), "trained"))
    assert verdict(result).startswith("working")
    result["trained"].update(validation_numbers(val_record(100, accuracy=0.31, cosine=0.95), "trained"))
    assert verdict(result).startswith("NOT working")  # collapsed


def test_outcome_reads_the_runs_last_validation_record(tmp_path):
    import json

    metrics = tmp_path / "metrics.jsonl"
    with pytest.raises(ValueError, match="no validation record"):
        last_validation(metrics)
    rows = [{"step": 1, "loss": 4.0}, val_record(1, 0.1), {"step": 2, "loss": 3.5}, val_record(2, 0.25),
            {"step": 3, "loss": 3.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = last_validation(metrics)
    assert last["step"] == 2 and validation_numbers(last, "x")["mlm_acc"] == 0.25
    with pytest.raises(ValueError, match="val/mlm_head/accuracy"):
        validation_numbers({"step": 2, "val/loss": 1.0}, "a run without the MLM head")


def test_outcome_rerun_of_a_failed_or_unfinished_demo_says_what_is_missing(tmp_path, capsys):
    from demo.outcome import main as outcome_main
    from demo.run import Stages

    out = tmp_path / "demo_output"
    out.mkdir()
    assert outcome_main([str(out)]) == 2 and "not a demo output" in capsys.readouterr().err
    (out / "demo.json").write_text('{"status": "running"}')  # killed before its first stage
    assert outcome_main([str(out)]) == 2
    assert "names no objective" in capsys.readouterr().err
    stages = Stages()
    stages.out, stages.record = out, {"objective": "taco"}
    stages.begin("pretrain", "pretraining")
    stages.fail(RuntimeError("pipeline.train exited with 1"))
    assert outcome_main([str(out)]) == 2
    err = capsys.readouterr().err
    assert "hf/taco: no converted model" in err and "'failed' at stage 'pretrain'" in err and "exited with 1" in err
