"""`cpt-sts` for a person and on degenerate input (issues 57 and 58): a table of the model and each floor per
split with intervals, a verdict line per split read from the paired interval, JSON only on request; a
progress bar on a terminal only; `--help` with the defaults; the random-init floor averaged over init
seeds; never a number where a Spearman or an interval does not exist (one pair, constant scores, a
collapsed model whose cosines are all equal, resamples that repeat one pair)."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import subprocess
import struct
import sys
import tempfile
import termios
from pathlib import Path

import numpy as np
import pytest

from pipeline.eval import sts
from pipeline.eval.sts_report import render, verdict
from tests.eval.conftest import write_sts

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_table_and_verdicts_say_what_the_json_holds(sts_model, tmp_path, capsys):
    data = write_sts(tmp_path / "sts", n_pairs=40)
    out = tmp_path / "sts.json"
    assert sts.main([str(sts_model), "--data", str(data), "--bootstrap", "100", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert not text.lstrip().startswith("{")  # a table, not JSON
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("dev (40 pairs)"))
    assert "test (40 pairs)" in header
    model_row = next(line for line in lines if line.startswith("model "))
    for split in ("dev", "test"):
        m = record["splits"][split]["model"]
        assert f"{m['spearman']:.2f} [{m['interval'][0]:.2f}, {m['interval'][1]:.2f}]" in model_row
        line = next(line for line in lines if line.startswith(f"{split}: model "))
        for ref, label in (("random_init", "random init"), ("token_overlap", "token overlap"),
                           ("input_embeddings", "input embeddings")):
            lo, hi = m[f"minus_{ref}"]["interval"]
            side = "above" if lo > 0 else "below" if hi < 0 else "inside"
            assert f"{side} {label} ({m[f'minus_{ref}']['spearman']:+.2f} [{lo:.2f}, {hi:.2f}])" in line
    assert "random init (mean of 3 init seeds)" in text and "spread over init seeds (sd)" in text
    assert record["random_init_seeds"] == [0, 1, 2]


def test_verdict_words_from_the_interval():
    record = {"model": {"spearman": 60.0,
                        "minus_random_init": {"spearman": 2.0, "interval": [1.0, 3.0]},
                        "minus_token_overlap": {"spearman": -2.0, "interval": [-3.0, -1.0]},
                        "minus_input_embeddings": {"spearman": 0.5, "interval": [-1.0, 2.0]}}}
    assert verdict("test", record) == ("test: model 60.00: above random init (+2.00 [1.00, 3.00]); inside input "
                                       "embeddings (+0.50 [-1.00, 2.00]); below token overlap (-2.00 [-3.00, -1.00])")
    no_boot = {"model": {"spearman": 60.0, "minus_random_init": {"spearman": 2.0}}}
    assert verdict("dev", no_boot) == "dev: model 60.00: +2.00 against random init (no side claimed: no bootstrap interval)"


def test_help_gives_the_defaults(capsys):
    with pytest.raises(SystemExit):
        sts.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 1000)", "(default: 0.95)", "(default: 3)", "(default: 64)", "--json", "--no-progress"):
        assert default in text, default


@pytest.mark.parametrize("tty, flag, drawn", [(True, [], True), (True, ["--no-progress"], False), (False, [], False)])
def test_progress_bar_on_a_terminal_only(sts_model, tmp_path, tty, flag, drawn):
    data = write_sts(tmp_path / "sts", n_pairs=10)
    cmd = [sys.executable, "-m", "pipeline.eval.sts", str(sts_model), "--data", str(data), "--bootstrap", "0",
           "--random-inits", "1", "--json", *flag]
    if tty:  # stderr a terminal (a pty), read while the command runs (a closed pty drops what is unread)
        main_fd, child_fd = pty.openpty()
        fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal's size
        with tempfile.TemporaryFile() as stdout:
            proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=stdout, stderr=child_fd)
            os.close(child_fd)
            chunks = []
            try:
                while chunk := os.read(main_fd, 65536):
                    chunks.append(chunk)
            except OSError:  # EIO: the command closed its end
                pass
            os.close(main_fd)
            code = proc.wait(timeout=300)
            stdout.seek(0)
            printed = stdout.read()
        err = b"".join(chunks).decode(errors="replace")
    else:
        done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, timeout=300)
        code, printed, err = done.returncode, done.stdout, done.stderr.decode()
    assert code == 0, err
    json.loads(printed)  # stdout stays clean JSON either way
    assert ("cpt-sts: embedding" in err) == drawn, err
    assert "Loading weights" not in err


@pytest.mark.parametrize("lines, says", [
    (1, "1 sentence pair; a Spearman correlation needs at least 2"),
    ("constant", "every score is 3; a Spearman correlation with constant scores is undefined (0/0)"),
])
def test_a_split_without_a_spearman_is_refused_before_compute(sts_model, tmp_path, capsys, monkeypatch, lines, says):
    """Old code: Spearman 0.0 with interval [0, 0], exit 0."""
    data = write_sts(tmp_path / "sts", n_pairs=10)
    rows = (data / "dev.tsv").read_text().splitlines()
    if lines == 1:
        rows = rows[:1]
    else:
        rows = ["\t".join(r.split("\t")[:4] + ["3.000"] + r.split("\t")[5:]) for r in rows]
    (data / "dev.tsv").write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(sts, "open_encoder", lambda *a, **k: pytest.fail("the model was opened"))
    assert sts.main([str(sts_model), "--data", str(data)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {data / 'dev.tsv'}: {says}"


@pytest.fixture(scope="module")
def collapsed_model(sts_model, tmp_path_factory) -> Path:
    """A real converted directory whose encoder collapsed: the last LayerNorm's weight is 0, so every token's
    state is that LayerNorm's bias, every sentence the same vector, every cosine 1."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path_factory.mktemp("collapsed") / "hf"
    shutil.copytree(sts_model, copy)
    weights = load_file(copy / "model.safetensors")
    last = max(int(k.split(".")[3]) for k in weights if k.startswith("bert.encoder.layer."))
    key = f"bert.encoder.layer.{last}.output.LayerNorm.weight"
    weights[key] = weights[key] * 0
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_a_collapsed_model_has_no_spearman_and_no_verdict(collapsed_model, tmp_path, capsys):
    """Old code: Spearman 0.0 [0.0, 0.0] and a difference to every floor, exit 0."""
    data = write_sts(tmp_path / "sts", n_pairs=20)
    assert sts.main([str(collapsed_model), "--data", str(data), "--bootstrap", "50", "--random-inits", "2",
                     "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    for split in ("dev", "test"):
        model = record["splits"][split]["model"]
        assert model["spearman"] is None and model["interval"] is None
        assert model["undefined"] == "every cosine is equal (1): a correlation with a constant is 0/0"
        assert all(model[f"minus_{r}"]["spearman"] is None and model[f"minus_{r}"]["interval"] is None
                   for r in sts.REFERENCES)
        assert record["splits"][split]["token_overlap"]["spearman"] > 0  # the floors are still measured
    text = render(record)
    model_row = next(line for line in text.splitlines() if line.startswith("model "))
    assert model_row.split()[1:] == ["undefined", "undefined"]
    assert "dev: no verdict: the model's Spearman is undefined (every cosine is equal (1)" in text


def test_an_interval_with_undefined_resamples_is_null():
    """3 pairs: some resamples draw one pair three times (no Spearman there): no interval, and why."""
    gold = np.array([1.0, 2.5, 4.0])
    predicted = {"model": [np.array([0.1, 0.5, 0.9])], "token_overlap": [np.array([0.3, 0.2, 0.9])]}
    draws = sts.bootstrap_draws(3, 200, seed=0)
    undefined = sum(len(set(d)) == 1 or len(set(gold[d])) == 1 for d in draws)
    assert undefined > 0
    out = sts.summarise(predicted, gold, draws, 0.95)
    assert out["model"]["spearman"] == 100.0 and out["model"]["interval"] is None
    assert out["model"]["interval_undefined"].startswith(f"{undefined} of 200 bootstrap resamples have no Spearman")
    assert out["model"]["minus_token_overlap"]["interval"] is None
