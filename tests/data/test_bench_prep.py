"""benchmarks.data.bench_prep runs end to end on a tiny corpus (a smoke test; timings are not checked)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.data.bench_prep import main
from tests.fixtures_data import stdlib_documents, write_corpus


def test_bench_prep_writes_both_reports(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus / "valid.txt", stdlib_documents(("bisect", "heapq", "textwrap")))
    out = tmp_path / "results"
    args = ["--corpus", str(corpus), "--repeat", "1", "--trials", "1", "--num-proc", "1", "--seq-len", "64",
            "--vocab-size", "300", "--batch", "8", "--reader-seconds", "0.05", "--out", str(out)]
    assert main(args) == 0
    prep = json.loads((out / "prep_throughput.json").read_text())
    assert [r["pipeline"].split(" (")[0] for r in prep["rows"]] == ["build_shards", "run_mlm recipe"]
    assert all(r["tokens_per_s"] > 0 and r["cpu_seconds"] > 0 for r in prep["rows"])
    assert prep["summary"]["prep_ratio"] > 0 and prep["summary"]["corpus_tokens"] > 1000
    reader = json.loads((out / "prep_reader.json").read_text())
    assert {r["views"] for r in reader["rows"]} >= {"masked", "wwm_masked", "span_masked", "crop", "shuffled"}
    assert all(r["samples_per_s"] > 0 for r in reader["rows"])
    for name in ("prep_throughput", "prep_reader"):
        assert (out / f"{name}.md").is_file() and (out / f"{name}.png").is_file()


def test_bench_prep_skips_cleanly_without_the_corpus(tmp_path: Path, capsys) -> None:
    assert main(["--corpus", str(tmp_path / "absent"), "--out", str(tmp_path / "results")]) == 0
    assert "skipping" in capsys.readouterr().out
    assert not (tmp_path / "results").exists()
