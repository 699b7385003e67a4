"""The two arms of the MLM-vs-HF parity test (once `benchmarks/throughput/mlm_vs_hf.py`): our real training command and
`BertForMaskedLM` in a plain loop.

* `run_pipeline`: `python -m pipeline.train --config tiny-mlm <overrides>` in a child process (DeepSpeed
  ZeRO-1, exactly what a user runs), then `pipeline.export.convert` of its final checkpoint;
* `train_hf`: `transformers.BertForMaskedLM` (`attn_implementation="sdpa"`) in a plain torch loop that
  starts from the weights the pipeline starts from (`pipeline.train.loop.build_run_model`, the one
  constructor, converted by `pipeline.model.hf_names.to_hf`) and is fed the same micro-batches
  (`PretrainBatches` + `CorruptionCollator`, built as `pipeline.train.loop.start` builds them), with the
  same per-step dropout seeding (`pipeline.seeding.reseed_dropout`), learning rate (`lr_at`), AdamW
  parameter groups / betas / eps / weight decay (`pipeline.train.optim.param_groups`) and clipping
  (`clip_like_deepspeed`, DeepSpeed's numerics);
* `compare`: step-by-step loss differences of two loss curves.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[2]
PRESET = "tiny-mlm"
THRESHOLDS = (1e-5, 1e-4, 1e-3, 1e-2)
WINDOWS = (10, 50)


def recipe_overrides(shards: Path, seed: int, steps: int, output_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """The demo recipe (`demo.run.DEMO_OVERRIDES`) with BERT's default zero output biases
    (`model.mlm_bias_init=zero`: the initialisation under comparison), every step logged, one final
    checkpoint; `extra` (`--set`) applied last, so it wins."""
    from demo.run import DEMO_OVERRIDES

    return [f"data.shards_dir={shards}", *DEMO_OVERRIDES, "model.mlm_bias_init=zero",
            f"train.total_steps={steps}", f"train.seed={seed}", "train.log_every=1",
            f"train.checkpoint_every={steps}", "train.keep_last=1", "train.tensorboard=false",
            "train.resume=never", f"train.output_dir={output_dir}", *extra]


def pipeline_command(overrides: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "pipeline.train", "--config", PRESET, *overrides]


def run_pipeline(overrides: Sequence[str], run_dir: Path, convert_to: Optional[Path] = None) -> dict:
    """The real training command in a child process (its own DeepSpeed / process-group state), log in
    `run_dir/train.log`; returns {"records": per-step metrics, "seconds", "command"}. With
    `convert_to`, the final checkpoint is converted to a Hugging Face directory there."""
    from pipeline.export.convert import convert
    from pipeline.train.metrics import read_jsonl

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a previous run's curve must not be read as this one's
    cmd = pipeline_command(overrides)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    started = time.perf_counter()
    with open(run_dir / "train.log", "w", encoding="utf-8") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), env=env).returncode
    seconds = time.perf_counter() - started
    if code != 0:
        tail = (run_dir / "train.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"pipeline.train exited with {code} (log: {run_dir / 'train.log'}):\n{tail}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    if convert_to is not None:
        convert(run_dir, convert_to, overwrite=True)
    return {"records": records, "seconds": seconds, "command": " ".join(["python", *cmd[1:]])}


def clip_like_deepspeed(params: Iterable[torch.nn.Parameter], clip: float) -> torch.Tensor:
    """DeepSpeed ZeRO-1/2's gradient clipping (`get_grad_norm_direct` + `unscale_and_clip_grads`, fp32,
    loss scale 1): per-tensor norms in fp64, their squares summed and cast to fp32, then

        g <- g * 1 / max(1, (||g|| + 1e-6) / clip)

    Returns the pre-clip global norm (what the pipeline logs as `grad_norm`). `clip_grad_norm_` computes
    the same quantity, but its fp32 norm of the large embedding gradient differs in the last bits; the
    arms must not differ in anything but the model and the loop."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch.stack([torch.linalg.vector_norm(g.detach().double()) for g in grads])
    total = norms.pow(2).sum().float().pow(0.5)
    if clip > 0:
        scale = torch.clamp((total + 1e-6) / clip, min=1.0)
        for g in grads:
            g.mul_(1.0 / scale)
    return total


def hf_from_ours(model: torch.nn.Module, encoder_config, special_tokens: dict, device: torch.device):
    """`BertForMaskedLM` (SDPA) holding exactly `model`'s weights; raises if any HF parameter is not
    covered or any value differs after loading."""
    from transformers import BertForMaskedLM

    from pipeline.export.hf_adapter import bert_config
    from pipeline.model.hf_names import to_hf

    state = to_hf(model.state_dict())
    hf = BertForMaskedLM._from_config(bert_config(encoder_config, special_tokens), attn_implementation="sdpa")
    _, unexpected = hf.load_state_dict(state, strict=False)
    loaded = hf.state_dict()
    uncovered = [k for k, _ in hf.named_parameters() if k not in state]  # tied tensors are de-duplicated here
    wrong = [k for k, v in state.items() if k in loaded and not torch.equal(loaded[k], v)]
    if unexpected or uncovered or wrong:
        raise RuntimeError(f"initial weights do not map onto BertForMaskedLM: unexpected {unexpected}, "
                           f"not set {uncovered}, different after loading {wrong}")
    if hf.cls.predictions.decoder.weight is not hf.bert.embeddings.word_embeddings.weight:
        raise RuntimeError("BertForMaskedLM's decoder is not tied to the word embeddings")
    return hf.to(device)


def train_hf(overrides: Sequence[str], steps: Optional[int] = None, init_seed: Optional[int] = None,
             lr_scale: float = 1.0, save_to: Optional[Path] = None) -> dict:
    """Train `BertForMaskedLM` on the run `overrides` describe (`train.total_steps` steps, or only the
    first `steps` of that schedule), the way `pipeline.train` would, in a plain torch loop; returns
    {"records": [{"step", "loss", "grad_norm", "lr"}], "seconds"}.

    `init_seed` / `lr_scale` change the initial weights / the learning rate of this arm only: they
    exist to show that `compare` detects a real training difference (the test uses them)."""
    from pipeline import seeding
    from pipeline.data.batch import move_batch
    from pipeline.train.run_config import check_run, load_config
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import PretrainBatches, open_dataset
    from pipeline.train.loop import build_run_model
    from pipeline.train.optim import lr_at, param_groups, set_lr

    cfg = load_config(PRESET, list(overrides))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = check_run(cfg, 1, device.type == "cuda")
    init_cfg = cfg if init_seed is None else load_config(PRESET, [*overrides, f"train.seed={init_seed}"])
    ours = build_run_model(init_cfg, plan)
    hf = hf_from_ours(ours, ours.config, dict(plan.manifest.special_tokens), device).train()
    dataset = open_dataset(cfg.data.shards_dir, cfg.data.verify_shards)
    collator = CorruptionCollator(ours.views, dataset.special_tokens, dataset.vocab_size, cfg.train.seed,
                                  **cfg.data.corruption)
    batches = PretrainBatches(dataset, collator, plan.batch, 0, cfg.train.seed, num_workers=cfg.data.num_workers)
    del ours
    optimizer = torch.optim.AdamW(param_groups(hf, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
    accum, total = plan.batch.grad_accum, cfg.train.total_steps
    records, started = [], time.perf_counter()
    for step in range(1, min(total, steps or total) + 1):
        seeding.reseed_dropout(cfg.train.seed, step, 0)
        lr = lr_at(step, cfg.optim, total) * lr_scale
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(accum):  # DeepSpeed scales each micro-batch's loss by 1 / grad_accum
            batch = move_batch(next(batches), device)
            loss = hf(input_ids=batch["masked_ids"], attention_mask=batch["attention_mask"],
                      labels=batch["mlm_labels"]).loss
            (loss / accum).backward()
            loss_sum += float(loss.detach())
        grad_norm = clip_like_deepspeed(hf.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        records.append({"step": step, "loss": loss_sum / accum, "grad_norm": float(grad_norm), "lr": lr})
    seconds = time.perf_counter() - started
    if save_to is not None:
        hf.save_pretrained(str(save_to))
    return {"records": records, "seconds": seconds}


def compare(ours: Sequence[dict], hf: Sequence[dict]) -> dict:
    """Per-step |loss_ours - loss_hf| over the steps both arms logged: the first step where it exceeds
    each of `THRESHOLDS` (None: never), its maximum over steps 1-10, 1-50 and all, and the relative
    difference of the pre-clip gradient norms at step 1."""
    a = {int(r["step"]): r for r in ours}
    b = {int(r["step"]): r for r in hf}
    steps = sorted(set(a) & set(b))
    if not steps:
        raise ValueError("the two arms logged no common step")
    diff = {s: abs(float(a[s]["loss"]) - float(b[s]["loss"])) for s in steps}
    out = {"steps_compared": len(steps)}
    for t in THRESHOLDS:
        out[f"first_step_diff_gt_{t:g}"] = next((s for s in steps if diff[s] > t), None)
    for w in WINDOWS:
        out[f"max_diff_steps_1_{w}"] = max(diff[s] for s in steps if s <= w)
    out["max_diff_all"] = max(diff.values())
    first = steps[0]
    out["grad_norm_rel_diff_step1"] = abs(a[first]["grad_norm"] - b[first]["grad_norm"]) / abs(b[first]["grad_norm"])
    return out


def agree(summary: dict, tolerance: float = 1e-4, window: int = 10) -> bool:
    """The verdict: the arms agree when |loss diff| stays within `tolerance` over the first `window` steps
    (later, float reassociation alone lets two equal computations drift apart)."""
    return summary[f"max_diff_steps_1_{window}"] <= tolerance
