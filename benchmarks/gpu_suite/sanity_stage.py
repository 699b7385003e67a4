"""Stage `sanity`: a base-size MLM trains on the WikiText-2 shards on the GPU, resumes exactly, and
converts to a transformers model that gives the same logits.

1. Run A: `mlm-cocolm-base` (BERT-base, MLM, its optimizer and bf16) on the carried WikiText-2
   shards (`--prepare`: valid + test, L = 128, the carried WordPiece tokenizer), `STEPS` steps of
   64 sequences, `train.deterministic=true`, checkpoints at steps N-1 and N. Checks: exit 0 (the
   non-finite guard exits 3), every logged loss finite, the loss falls (mean of the last 10 logged
   steps <= `FALL` x the mean of the first 10).
2. Run B resumes from A's step N-1 checkpoint in another directory and trains step N. Check: B's
   step-N loss equals A's (relative difference <= `RESUME_TOL`; bitwise on the CPU rehearsal).
3. A's last checkpoint is converted (`pipeline.export.convert.convert`) and loaded with
   `AutoModelForMaskedLM` on the same device; the training model rebuilt from the same checkpoint
   (`model_from_meta` + the consolidated fp32 weights) gives the reference logits on a probe batch
   of two shard rows, the second padded after 20 tokens (TF32 off). Check: relative error
   ||hf - ours|| / ||ours|| <= `LOGITS_TOL`.

The dry run: tiny model, fp32 on the CPU, a tokenizer and shards built from the project's own docs
(no carried data needed), a few steps; every check but "loss falls" (too few steps) is judged.
"""
from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.gpu_suite import targets as T
from benchmarks.gpu_suite.plan import CARRY_DIR, REPO
from benchmarks.gpu_suite.stage_io import StageContext

PRESET = "mlm-cocolm-base"
SHARDS = f"{CARRY_DIR}/shards-wikitext-L128"
STEPS, MICRO_BATCH = 1000, 64
DRY_STEPS, DRY_MICRO_BATCH = 6, 4
FALL = 0.9
RESUME_TOL = 1e-6
LOGITS_TOL = 1e-4


def dry_shards(work: Path) -> Path:
    """Tiny WordPiece tokenizer and L=32 shards from the project's own Markdown (always present)."""
    from data_prep.build_shards import build_shards
    from data_prep.train_tokenizer import train_tokenizer

    corpus = work / "docs.txt"  # documents separated by blank lines, as data_prep reads .txt
    corpus.write_text("\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]))
    tok = train_tokenizer([str(corpus)], work / "tokenizer", vocab_size=600, progress=False)
    build_shards([str(corpus)], tok, work / "shards", seq_len=32, num_proc=1, progress=False)
    return work / "shards"


def overrides(ctx: StageContext, shards: Path, out: Path, steps: int, resume: str = "never") -> list[str]:
    micro = DRY_MICRO_BATCH if ctx.dry_run else MICRO_BATCH
    seq_len = 32 if ctx.dry_run else 128
    return [f"data.shards_dir={shards}", f"data.seq_len={seq_len}", f"data.micro_batch_size={micro}",
            f"data.global_batch_size={micro}", f"train.total_steps={steps}", f"train.checkpoint_every={steps - 1}",
            "train.keep_last=2", "train.log_every=1", f"train.resume={resume}", "train.deterministic=true",
            "train.tensorboard=false", "train.progress_bar=false", f"train.output_dir={out}", "data.num_workers=0",
            f"optim.warmup_steps={max(1, steps // 10)}"] + (
        ["model.size=tiny", "deepspeed.precision=fp32"] if ctx.dry_run else [])


def losses(run_dir: Path) -> dict[int, float]:
    from pipeline.train.metrics import read_jsonl

    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def probe_batch(shards: Path):
    import torch

    from pipeline.data.reader import ShardDataset

    dataset = ShardDataset(str(shards))
    ids = torch.stack([torch.as_tensor(dataset[i]["input_ids"].astype("int64")) for i in (0, 1)])
    mask = torch.ones_like(ids)
    ids[1, 20:] = dataset.special_tokens["pad"]
    mask[1, 20:] = 0
    return ids, mask


def compare_logits(checkpoints: Path, hf_dir: Path, shards: Path, device) -> dict[str, float]:
    """Relative error and max |difference| of the converted model's logits against the training model's."""
    import torch
    from transformers import AutoModelForMaskedLM

    from pipeline.export.convert import consolidate_fp32_weights, resolve_tag_dir
    from pipeline.model.build import model_from_meta
    from pipeline.model.encoder import fuse_qkv
    from pipeline.train.run_meta import RunMeta

    tag = resolve_tag_dir(checkpoints)
    ours = model_from_meta(RunMeta.read(tag))
    state, _ = consolidate_fp32_weights(tag)
    ours.load_state_dict(fuse_qkv(state))  # strict: every weight from the checkpoint
    ours.to(device).eval()
    hf = AutoModelForMaskedLM.from_pretrained(str(hf_dir)).to(device).eval()
    ids, mask = (t.to(device) for t in probe_batch(shards))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            ref = ours.cls(ours.bert(ids, mask).last_hidden).float()
            got = hf(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    keep = mask.bool()  # padded positions are not compared (neither model defines them)
    diff = (got - ref)[keep]
    return {"logits_rel_err": (diff.norm() / ref[keep].norm().clamp_min(1e-30)).item(),
            "logits_max_abs_diff": diff.abs().max().item(), "logits_std": ref[keep].std().item()}


def run(ctx: StageContext) -> int:
    from benchmarks.gpu_suite.env_stage import require_environment
    from pipeline.config.run import load_config
    from pipeline.export.convert import convert
    from pipeline.train.checkpoint import CHECKPOINT_DIR
    from pipeline.train.loop import train

    require_environment(ctx)
    work = Path(tempfile.mkdtemp(prefix="gpu_suite_sanity_"))
    applicable = True
    steps = DRY_STEPS if ctx.dry_run else STEPS
    facts: dict[str, Any] = {"preset": PRESET, "steps": steps}
    try:
        if ctx.dry_run:
            shards = dry_shards(work)
        else:
            shards = REPO / SHARDS
            if not (shards / "manifest.json").is_file():
                raise FileNotFoundError(f"{shards}: no prepared shards; run `python -m benchmarks.gpu_suite --prepare` "
                                        f"here and carry {CARRY_DIR}")
        run_a, run_b = work / "a", work / "b"
        facts["exit_a"] = train(load_config(PRESET, overrides(ctx, shards, run_a, steps)))
        curve = losses(run_a)
        values = [curve[s] for s in sorted(curve)]
        facts["nonfinite_losses"] = sum(1 for v in values if not math.isfinite(v))
        head, tail = values[:10], values[-10:]
        facts["loss_first10"] = sum(head) / max(1, len(head))
        facts["loss_last10"] = sum(tail) / max(1, len(tail))
        tags = [t for t in (run_a / CHECKPOINT_DIR).iterdir() if t.is_dir()]
        earlier = [t for t in tags if t.name.rpartition("_")[2].isdigit() and int(t.name.rpartition("_")[2]) == steps - 1]
        if not earlier:
            raise FileNotFoundError(f"{run_a / CHECKPOINT_DIR}: no checkpoint of step {steps - 1} "
                                    f"(have {[t.name for t in tags]})")
        facts["resume_from"] = earlier[0].name
        facts["exit_b"] = train(load_config(PRESET, overrides(ctx, shards, run_b, steps, str(earlier[0]))))
        facts["loss_a_last"], facts["loss_b_last"] = curve.get(steps), losses(run_b).get(steps)
        facts["resume_rel_diff"] = (abs(facts["loss_a_last"] - facts["loss_b_last"]) / abs(facts["loss_a_last"])
                                    if None not in (facts["loss_a_last"], facts["loss_b_last"]) else None)
        hf_dir = convert(run_a / CHECKPOINT_DIR, work / "hf")
        facts.update(compare_logits(run_a / CHECKPOINT_DIR, hf_dir, shards, ctx.device))
        draw = _curve_chart(curve)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    targets = [
        T.target("training exits 0 and every loss is finite",
                 float(facts["exit_a"] == 0 and facts["nonfinite_losses"] == 0), ">=", 1.0, applicable),
        T.target("loss falls: last-10 mean / first-10 mean", T.ratio(facts["loss_last10"], facts["loss_first10"]),
                 "<=", FALL, not ctx.dry_run, "not judged on the dry run (a few steps)" if ctx.dry_run else ""),
        T.target("resumed step-N loss: relative difference", facts["resume_rel_diff"], "<=", RESUME_TOL,
                 applicable and facts["exit_b"] == 0),
        T.target("converted logits: relative error", facts["logits_rel_err"], "<=", LOGITS_TOL, applicable),
    ]
    if ctx.dry_run:
        ctx.notes.append("dry run: tiny model, fp32 on the CPU, shards from the project's docs")
    ctx.write({"training sanity": [facts]}, targets, charts={"loss": draw})
    return 0 if all(t["met"] is not False for t in targets) else 1


def _curve_chart(curve: dict[int, float]):
    from benchmarks.common.report import line_chart

    points = [(s, v) for s, v in sorted(curve.items()) if math.isfinite(v)]
    return lambda path: line_chart({"run A (MLM)": points}, path, "training sanity: MLM loss", "step", "loss")
