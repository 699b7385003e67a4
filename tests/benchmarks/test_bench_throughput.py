"""Throughput benchmark: a CI-sized real run gives a well-formed report; its arithmetic and errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common.runs import MFU_FORMULA, add_arch_ratios, bert_partner_size
from pipeline.train.exit_record import last_error_line
from benchmarks.throughput.bench_throughput import (
    BenchCase,
    add_hf_ratios,
    add_overhead_ratios,
    arch_sizes,
    cases,
    main,
    paper_objective_options,
    parse_args,
    preset_grad_accum,
    summarize_records,
    train_overrides,
)
from benchmarks.data.synthetic_shards import SPECIAL_TOKENS, write_synthetic_shards
from pipeline.train.run_config import load_config
from pipeline.data.config import plan_batches

REPO = Path(__file__).resolve().parents[2]


def record(step: int, step_time: float, tokens_per_s: float, **extra) -> dict:
    return {"step": step, "step_time_s": step_time, "tokens_per_s": tokens_per_s, "samples_per_s": 1.0,
            "tflops_per_device": 0.5, **extra}


def test_summarize_records_skips_warmup_and_uses_the_median() -> None:
    records = [record(1, 9.0, 10.0, peak_rss_gb=1.0), record(2, 1.0, 100.0), record(3, 3.0, 100.0),
               record(4, 2.0, 50.0, peak_rss_gb=2.5)]
    out = summarize_records(records, warmup=1)
    assert out["measured_steps"] == 3 and out["step_time_s"] == 2.0
    assert out["tokens_per_s"] == pytest.approx((100 + 300 + 100) / 6.0)  # total tokens / total time
    assert out["mfu"] is None and out["peak_mem_gb"] == 2.5 and out["memory"] == "cpu peak rss"
    gpu = summarize_records([record(1, 1.0, 1.0, mfu=0.4), record(2, 1.0, 1.0, mfu=0.5, peak_mem_gb=7.0)], 0)
    assert gpu["mfu"] == pytest.approx(0.45) and gpu["peak_mem_gb"] == 7.0 and gpu["memory"] == "cuda max allocated"
    with pytest.raises(ValueError, match="no metrics after the 4 warm-up steps"):
        summarize_records(records, warmup=4)


def test_overhead_ratio_is_against_mlm_of_the_same_configuration() -> None:
    base = dict(preset="tiny", seq_len=128, zero=1, precision="fp32", micro_batch=8)
    rows = [{**base, "objective": "mlm", "step_time_s": 2.0}, {**base, "objective": "taco", "step_time_s": 2.2},
            {**base, "objective": "taco", "zero": 2, "step_time_s": 5.0},
            {**base, "objective": "capt", "step_time_s": None, "error": "exit 1"}]
    add_overhead_ratios(rows)
    assert [r["overhead_vs_mlm"] for r in rows] == [1.0, pytest.approx(1.1), None, None]


def test_overrides_and_argument_errors(tmp_path: Path, capsys) -> None:
    case = BenchCase("taco", "large", 512, 3, "bf16", 16)
    ov = train_overrides(case, tmp_path / "s", tmp_path / "r", 13, world_size=4, options="paper", extra=["a.b=1"])
    assert "deepspeed.config=zero3" in ov and "data.global_batch_size=64" in ov and "model.size=large" in ov
    assert "train.total_steps=13" in ov and ov[-1] == "a.b=1"
    assert ov[-2] == 'objective_options={"taco": {"window": 5, "num_negatives": 50, "tau": 0.07}}'  # taco-small's
    assert not any(o.startswith("objective_options=") for o in train_overrides(case, tmp_path, tmp_path, 1, 1, "tiny", []))
    large_cocolm = BenchCase("cocolm", "large", 512, 1, "bf16", 16)
    assert paper_objective_options("cocolm", "large")["cocolm"]["generator_layers"] == 6  # cocolm-large's
    assert paper_objective_options("infoword", "base")["infoword"]["num_negatives"] == "all"
    assert paper_objective_options("mlm", "large") == {}
    load_config("tiny-cocolm", [o for o in train_overrides(large_cocolm, tmp_path, tmp_path, 1, 1, "paper", [])
                                if o.startswith("objective_options=")])  # a valid override
    for argv, message in ((["--objectives", "mlm,nope"], "nope"), (["--zero", "0"], "--zero"),
                          (["--seq-lens", "128,x"], "128,x"), (["--sizes", "huge"], "huge")):
        with pytest.raises(SystemExit):
            parse_args([*argv, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err
    assert main(["--shards", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert last_error_line("a\nerror: data.shards_dir=/x: no such directory\n") == \
        "error: data.shards_dir=/x: no such directory"
    assert last_error_line("Traceback\n  File x\nRuntimeError: CUDA out of memory\n") == "RuntimeError: CUDA out of memory"


def test_gradient_accumulation_is_the_presets_unless_given(tmp_path: Path, capsys) -> None:
    """The runs step the optimizer as the presets they load do (not every micro-batch): by default the
    tiny presets' accumulation on one rank, whatever the world size (weak scaling); `--grad-accum N`
    overrides it; the global batch is micro x accumulation x world size."""
    presets = plan_batches(load_config("tiny-mlm").data, 1).grad_accum
    assert presets > 1  # tiny-mlm: global 8 = micro 4 x 2
    assert preset_grad_accum(["mlm", "taco", "capt", "cocolm", "infoword", "mlm-nce"]) == presets
    args = parse_args(["--objectives", "taco", "--world-size", "4", "--out", str(tmp_path)])
    assert args.grad_accum == presets
    assert parse_args(["--grad-accum", "16", "--out", str(tmp_path)]).grad_accum == 16
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            parse_args(["--grad-accum", bad, "--out", str(tmp_path)])
        assert "--grad-accum" in capsys.readouterr().err
    case = BenchCase("taco", "tiny", 64, 1, "fp32", 4)
    for world, accum in ((1, presets), (4, 16)):
        ov = train_overrides(case, tmp_path, tmp_path, 5, world, "tiny", [], grad_accum=accum)
        assert f"data.global_batch_size={4 * accum * world}" in ov
        assert plan_batches(load_config("tiny-taco", ov).data, world).grad_accum == accum


def test_synthetic_shards_are_read_by_the_training_reader(tmp_path: Path) -> None:
    from pipeline.data.reader import ShardDataset

    manifest = write_synthetic_shards(tmp_path / "syn", vocab_size=300, seq_len=16, rows=50, rows_per_shard=20)
    ds = ShardDataset(tmp_path / "syn")
    assert len(ds) == 50 and len(manifest.shards) == 3 and ds.vocab_size == 300
    row = ds[49]["input_ids"]
    assert row[0] == SPECIAL_TOKENS["cls"] and row[-1] == SPECIAL_TOKENS["sep"]
    assert row[1:-1].min() >= len(SPECIAL_TOKENS) and row.max() < 300
    again = write_synthetic_shards(tmp_path / "syn", vocab_size=300, seq_len=16, rows=50, rows_per_shard=20)
    assert again == manifest  # identical parameters: reused, not rewritten
    with pytest.raises(ValueError, match="vocab_size 5"):
        write_synthetic_shards(tmp_path / "bad", vocab_size=5, seq_len=16)


@pytest.mark.timeout(120)
def test_cpu_run_writes_a_well_formed_report(tmp_path: Path, tiny_shards_dir: Path, monkeypatch) -> None:
    """Two real `pipeline.train` runs (MLM, TACO) plus one that fails on a bad override."""
    monkeypatch.chdir(REPO)  # the training subprocess imports `pipeline` from the checkout
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    out = tmp_path / "bench"
    code = main(["--objectives", "taco", "--sizes", "tiny", "--seq-lens", "64", "--micro-batch", "4",
                 "--steps", "2", "--warmup", "1", "--shards", str(tiny_shards_dir), "--out", str(out)])
    assert code == 0
    report = json.loads((out / "throughput.json").read_text())
    rows = {r["objective"]: r for r in report["rows"]}
    assert set(rows) == {"mlm", "taco"} and report["hardware"]["torch"]
    for row in rows.values():
        assert row["error"] is None and row["measured_steps"] == 2 and row["world_size"] == 1
        # the presets' accumulation (2 micro-batches of 4 x 64 per step), not an optimizer step per micro-batch
        assert row["grad_accum"] == 2 and 4 * 64 < row["tokens_per_step"] <= 2 * 4 * 64
        assert row["step_time_s"] > 0 and row["peak_mem_gb"] > 0
        assert row["tokens_per_s"] > 0 and row["wall_s"] > 2 * row["step_time_s"]
    assert rows["mlm"]["overhead_vs_mlm"] == 1.0 and rows["taco"]["overhead_vs_mlm"] > 0
    md = (out / "throughput.md").read_text()
    assert "| objective |" in md and "taco/tiny/L64/z1/fp32" in md
    for png in ("throughput.png", "throughput_overhead.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert not (out / "work" / "runs").exists()  # run directories are cleaned up

    code = main(["--objectives", "mlm", "--no-mlm", "--seq-lens", "64", "--steps", "1", "--warmup", "0",
                 "--shards", str(tiny_shards_dir), "--set", "model.bogus=1", "--out", str(tmp_path / "bad")])
    assert code == 1  # nothing measured
    failed = json.loads((tmp_path / "bad" / "throughput.json").read_text())["rows"][0]
    assert "model.bogus" in failed["error"] and failed.get("step_time_s") is None


def test_hf_ratio_is_against_the_baseline_of_the_same_shape() -> None:
    base = dict(preset="large", seq_len=128, precision="bf16", micro_batch=256)
    rows = [{**base, "objective": "hf-bert", "zero": 0, "tokens_per_s": 100.0},
            {**base, "objective": "mlm", "zero": 1, "tokens_per_s": 150.0},
            {**base, "objective": "mlm", "zero": 1, "seq_len": 512, "tokens_per_s": 90.0},
            {**base, "objective": "taco", "zero": 1, "tokens_per_s": None, "error": "exit 1"}]
    lines = add_hf_ratios(rows)
    assert [r["vs_hf_bert"] for r in rows] == [None, 1.5, None, None]
    assert lines == ["mlm large L128 bf16 mb256 z1: 150 / 100 tokens/s = 1.50x hf-bert"]


@pytest.mark.timeout(180)
def test_cpu_run_with_the_hugging_face_baseline(tmp_path: Path, tiny_shards_dir: Path, monkeypatch, capsys) -> None:
    """`--hf-baseline` end to end on the CPU: an `hf-bert` row from a real BertForMaskedLM loop on the
    same shards, the ratio and the MFU formula next to the table."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    out = tmp_path / "bench"
    code = main(["--objectives", "mlm", "--seq-lens", "64", "--micro-batch", "4", "--steps", "2", "--warmup", "1",
                 "--shards", str(tiny_shards_dir), "--hf-baseline", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    rows = {r["objective"]: r for r in json.loads((out / "throughput.json").read_text())["rows"]}
    assert set(rows) == {"mlm", "hf-bert"}
    hf, mlm = rows["hf-bert"], rows["mlm"]
    assert hf["error"] is None and hf["measured_steps"] == 2 and hf["tokens_per_s"] > 0 and hf["tflops_per_device"] > 0
    assert hf["grad_accum"] == mlm["grad_accum"] == 2 and hf["tokens_per_step"] > 4 * 64  # same accumulation
    assert mlm["vs_hf_bert"] == pytest.approx(mlm["tokens_per_s"] / hf["tokens_per_s"])
    assert MFU_FORMULA in printed and "x hf-bert" in printed
    md = (out / "throughput.md").read_text()
    assert "hf-bert/tiny/L64/z0/fp32" in md and "2 N h V" in md and "vs_hf_bert" in md
    with pytest.raises(SystemExit):
        parse_args(["--hf-baseline", "--world-size", "2", "--out", str(tmp_path)])
    assert "--hf-baseline compares one device" in capsys.readouterr().err


def test_each_modernbert_size_pairs_with_the_bert_size_of_its_shape() -> None:
    assert {size: bert_partner_size("modernbert", size) for size in ("tiny", "small", "base", "large", "large-24")} == \
        {"tiny": None, "small": "capt-small", "base": None, "large": None, "large-24": "large"}
    assert bert_partner_size("modernbert", "nope") is None


def test_arch_ratio_pairs_only_the_same_objective_shape_and_configuration() -> None:
    """A ModernBERT row's ratio is to the BERT row of its objective, paired size, length, ZeRO stage,
    precision and micro-batch; every row without one (other length, other ZeRO stage, unpaired size,
    failed partner) gets None, not a ratio to some other BERT row."""
    base = dict(seq_len=128, zero=1, precision="bf16", micro_batch=32)
    bert = [{**base, "arch": "bert", "objective": "mlm", "preset": "large", "tokens_per_s": 100.0, "mfu": 0.5},
            {**base, "arch": "bert", "objective": "taco", "preset": "large", "tokens_per_s": 80.0, "mfu": 0.4},
            {**base, "arch": "bert", "objective": "mlm", "preset": "large", "zero": 2, "tokens_per_s": 60.0},
            {**base, "arch": "bert", "objective": "capt", "preset": "large", "error": "exit 1"},
            {**base, "arch": "bert", "objective": "mlm", "preset": "capt-small", "tokens_per_s": 1000.0, "mfu": 0.1}]
    modern = [{**base, "arch": "modernbert", "objective": "mlm", "preset": "large-24", "tokens_per_s": 110.0, "mfu": 0.45},
              {**base, "arch": "modernbert", "objective": "taco", "preset": "large-24", "tokens_per_s": 96.0},
              {**base, "arch": "modernbert", "objective": "mlm", "preset": "large-24", "seq_len": 512, "tokens_per_s": 9.0},
              {**base, "arch": "modernbert", "objective": "mlm", "preset": "large-24", "zero": 3, "tokens_per_s": 9.0},
              {**base, "arch": "modernbert", "objective": "mlm", "preset": "large", "tokens_per_s": 9.0},
              {**base, "arch": "modernbert", "objective": "capt", "preset": "large-24", "tokens_per_s": 9.0},
              {**base, "arch": "modernbert", "objective": "infoword", "preset": "large-24", "error": "exit 1"}]
    lines = add_arch_ratios(bert + modern)
    assert [r["tokens_vs_bert"] for r in modern] == [pytest.approx(1.1), pytest.approx(1.2), None, None, None, None, None]
    assert [r["mfu_vs_bert"] for r in modern] == [pytest.approx(0.9), None, None, None, None, None, None]  # taco: no MFU
    assert all(r["tokens_vs_bert"] is None and r["mfu_vs_bert"] is None for r in bert)
    assert lines[0] == ("modernbert mlm large-24 vs bert large seq_len=128 zero=1 precision=bf16 micro_batch=32: "
                        "110 / 100 tokens/s = 1.100x, MFU 0.900x") and len(lines) == 2
    # the GPU suite's rows name their fields differently; the same rule through `name` / `size` / `match`
    rows = [{"row": "mlm", "arch": "bert", "size": "large", "engine": "zero1", "tokens_per_s": 4.0},
            {"row": "mlm", "arch": "modernbert", "size": "large-24", "engine": "zero1", "tokens_per_s": 5.0},
            {"row": "mlm", "arch": "modernbert", "size": "large-24", "engine": "zero2", "tokens_per_s": 5.0}]
    add_arch_ratios(rows, name="row", size="size", match=("engine",))
    assert [r["tokens_vs_bert"] for r in rows] == [None, 1.25, None]


def test_archs_run_both_families_side_by_side(tmp_path: Path, capsys) -> None:
    assert arch_sizes(["bert", "modernbert"], ["capt-small", "small", "tiny"]) == \
        [("bert", "capt-small"), ("modernbert", "small"), ("bert", "tiny"), ("modernbert", "tiny")]
    assert arch_sizes(["bert", "modernbert"], ["bert:large", "modernbert:large-24"]) == \
        [("bert", "large"), ("modernbert", "large-24")]
    args = parse_args(["--archs", "bert,modernbert", "--sizes", "capt-small,small", "--objectives", "taco",
                       "--hf-baseline", "--out", str(tmp_path)])
    labels = [(c.arch, c.objective, c.preset) for c in cases(args)]
    assert labels == [("bert", "hf-bert", "capt-small"), ("bert", "mlm", "capt-small"), ("bert", "taco", "capt-small"),
                      ("modernbert", "mlm", "small"), ("modernbert", "taco", "small")]  # hf-bert: BERT shapes only
    case = BenchCase("mlm", "small", 128, 1, "fp32", 8, "modernbert")
    ov = train_overrides(case, tmp_path, tmp_path, 3, 1, "tiny", [])
    cfg = load_config("tiny-mlm", ov)
    assert (cfg.model.arch, cfg.model.size) == ("modernbert", "small") and case.label.startswith("modernbert-mlm-small")
    assert BenchCase("mlm", "tiny", 128, 1, "fp32", 8).label == "mlm-tiny-L128-z1-fp32-mb8"  # BERT labels unchanged
    assert paper_objective_options("cocolm", "large-24")["cocolm"]["generator_layers"] == 6  # cocolm-large's
    for argv, message in ((["--sizes", "small"], "no size 'small' in bert"),
                          (["--archs", "bert,gpt"], "--archs"),
                          (["--archs", "bert", "--sizes", "modernbert:small"], "modernbert is not in --archs"),
                          (["--set", "model.arch=modernbert"], "--archs")):
        with pytest.raises(SystemExit):
            parse_args([*argv, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err


def test_mfu_formula_names_both_families_and_matches_the_flop_counters() -> None:
    """The printed formula is what the counters compute: per token, ModernBERT large-24 against BERT-large
    with the MLM head on 15% of the rows and V = 30,522 is 0.972 at L=128 and 0.938 at L=512 (GeGLU 2624
    against FFN 4096; 16 of 24 layers attend within the 128-token window)."""
    import torch

    from pipeline.model.config import ModelConfig
    from pipeline.model.modernbert import ModernBertConfig, ModernBertLayerStack
    from pipeline.train.metrics import layer_work_flops

    assert "for BERT" in MFU_FORMULA and "for ModernBERT" in MFU_FORMULA and "3 h f" in MFU_FORMULA
    assert "s (2w + 1) - w (w + 1)" in MFU_FORMULA
    bert = ModelConfig(arch="bert", size="large").shape()
    with torch.device("meta"):  # pass_flops reads the config and the layer pattern only
        stack = ModernBertLayerStack(ModernBertConfig(**ModelConfig(arch="modernbert", size="large-24").shape(),
                                                      vocab_size=30522, max_position=512))
    h, vocab, batch = 1024, 30522, 4
    for length, expected in ((128, 0.972), (512, 0.938)):
        tokens = batch * length
        head = 2.0 * 0.15 * tokens * h * (h + vocab)
        bert_flops = bert["num_layers"] * layer_work_flops(tokens, batch * length ** 2, h, bert["ffn_size"]) + head
        modern_flops = stack.pass_flops([length] * batch) + head
        assert modern_flops / bert_flops == pytest.approx(expected, abs=5e-4)
