"""Running `pipeline.train` for a benchmark: the one set of quiet run controls, the one way to time a
training step, and the small helpers the benchmark scripts share (flag lists, the MFU formula,
ModernBERT-vs-BERT ratios; a failed run's error line is `pipeline.train.exit_record.last_error_line`).

Timing a step (`timed_steps`): the run is built exactly as `pipeline.train.loop.train` builds it
(`build_run`: the preset's DeepSpeed engine file, its objective options and optimizer settings, the
real data path and collator), then the loop's own step is taken, `Run.train_step(step,
record_metrics=False)`: the phase and the learning rate from the run's schedule (so a phase's own LR
segment applies), dropout reseed, forward, backward, optimizer step, the step's one all-reduce. No
step records metrics, writes a metrics line or saves a checkpoint (those are the loop's, around the
step). Each step ends with a device synchronize and is timed alone; `summarize` gives the median step time, the spread
(max - min) / median, tokens/s = tokens / time and MFU = FLOPs / time / peak over the timed steps
(`MFU_FORMULA`, FLOPs from the loop's own counter).
"""
from __future__ import annotations

import gc
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

#: How MFU is computed, per family: what the training loop's FLOP counter adds up (`pipeline.train.metrics`
#: for BERT, `ModernBertLayerStack.pass_flops` for ModernBERT); the hf-bert row applies BERT's to the same model.
MFU_FORMULA = ("MFU = FLOPs / (step time x devices x peak); FLOPs per micro-batch = 3 [n_layers (2 B s (4 h^2 + 2 h f) "
               "+ 4 B s^2 h) + 2 N h^2 + 2 N h V] for BERT, 3 [sum_l (2 T (4 h^2 + 3 h f) + 4 h P_l) + 2 N h^2 + 2 N h V] "
               "for ModernBERT (T tokens processed; 3 h f: GeGLU's W_i maps h to 2f; P_l = sum_b s_b^2 in global layers, "
               "sum_b window_pairs(s_b, w) in local ones, w = local_attention / 2, window_pairs(s, w) = s (2w + 1) - "
               "w (w + 1) for s > w, else s^2) (Megatron-style; MLM head on the N predicted rows only; "
               "backward = 2x forward; every extra encoder pass of an objective counted the same way)")
#: What a ModernBERT row shares with its BERT partner besides the objective and the shape (bench_throughput's rows).
ARCH_MATCH = ("seq_len", "zero", "precision", "micro_batch")


def quiet_overrides(output_dir: Path | str, total_steps: int, log_every: int = 1,
                    checkpoint_every: Optional[int] = None, resume: str = "never", keep_last: int = 1) -> list[str]:
    """The run control of a benchmark's training run: `total_steps` steps into `output_dir`, metrics every
    `log_every` steps, one checkpoint at the end (or every `checkpoint_every`), no TensorBoard, no progress bar."""
    return [f"train.output_dir={output_dir}", f"train.total_steps={total_steps}", f"train.log_every={log_every}",
            f"train.checkpoint_every={checkpoint_every or total_steps}", f"train.keep_last={keep_last}",
            f"train.resume={resume}", "train.tensorboard=false", "train.progress_bar=false"]


def timed_steps(cfg: Any, warmup: int, steps: int, profile_steps: int = 0) -> dict[str, Any]:
    """Build the run as `train()` does (`pipeline.train.loop.build_run`) and time `warmup` + `steps` of the
    loop's own step (`Run.train_step`, unlogged) as the module docstring says. `profile_steps` more steps
    after the timed ones run under the profiler (`common.breakdown.profile_window`): the result's
    `breakdown`, never part of the timed numbers (`cfg.train.total_steps` must cover all three)."""
    import torch

    from benchmarks.common.breakdown import profile_window
    from pipeline.train.loop import build_run, torch_process_state
    from pipeline.train.metrics import device_peak_flops

    cuda = torch.cuda.is_available()
    times, tokens, flops = [], [], []
    breakdown = None
    with torch_process_state(cfg.train.deterministic, cfg.deepspeed.tf32):
        run = build_run(cfg)
        try:
            for step in range(1, warmup + steps + 1):
                started = time.perf_counter()
                result = run.train_step(step, record_metrics=False)
                if cuda:
                    torch.cuda.synchronize()
                if step > warmup:
                    times.append(time.perf_counter() - started)
                    tokens.append(result.tokens)
                    flops.append(result.flops)
            if profile_steps:
                later = iter(range(warmup + steps + 1, warmup + steps + profile_steps + 1))
                breakdown = profile_window(lambda: run.train_step(next(later), record_metrics=False), profile_steps,
                                           cuda)
        finally:
            run.close()
    out = summarize(times, tokens, flops, device_peak_flops(cfg.deepspeed.precision), run.plan.batch.global_batch_size)
    return out if breakdown is None else {**out, "breakdown": breakdown}


def summarize(times: list[float], tokens: list[float], flops: list[float], peak: Optional[float],
              samples_per_step: int) -> dict[str, Any]:
    """Rates over the timed steps: median step time, spread, tokens/s, sequences/s, TFLOP/s and MFU over their sum."""
    import torch

    total = sum(times)
    median = statistics.median(times)
    out = {"measured_steps": len(times), "step_time_s": median, "spread": (max(times) - min(times)) / median,
           "tokens_per_s": sum(tokens) / total, "samples_per_s": samples_per_step * len(times) / total,
           "tflops_per_device": sum(flops) / total / 1e12, "mfu": sum(flops) / total / peak if peak else None}
    if torch.cuda.is_available():
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def fresh_memory() -> dict[str, float]:
    """Free what earlier runs of this process left (engines still alive hold their model and optimizer
    through hooks the garbage collector cannot see: `destroy()` them) and reset the peak; returns what is resident."""
    import torch

    gc.collect()
    try:
        from deepspeed import DeepSpeedEngine

        with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated attributes
            warnings.simplefilter("ignore")
            engines = [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]
        for engine in engines:
            engine.destroy()
        del engines
    except ImportError:
        pass
    gc.collect()
    if not torch.cuda.is_available():
        return {}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {"resident_before_gb": round(torch.cuda.memory_allocated() / 2**30, 2)}


def parse_list(text: str, kind: type = str) -> list:
    """`"a,b"` -> `["a", "b"]` (converted with `kind`); a clear error names the bad item."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"empty list {text!r}")
    try:
        return [kind(t) for t in items]
    except ValueError as err:
        raise ValueError(f"{text!r}: {err}") from err


def family_sizes(arch: str) -> dict[str, dict[str, int]]:
    """Size presets of a family (`ModelConfig.size_presets`: the model config's own dispatch)."""
    from pipeline.model.config import ModelConfig

    return ModelConfig(arch=arch).size_presets()


def bert_partner_size(arch: str, size: str) -> Optional[str]:
    """The BERT size preset of the same shape (layers, hidden size, heads) as `arch`'s `size`, or None:
    ModernBERT `small` <-> BERT `capt-small` (6 x 256 x 4), `large-24` <-> `large` (24 x 1024 x 16). The
    MLP differs by design (GeGLU against a GELU FFN), so it is not part of the shape compared."""
    shape = ("num_layers", "hidden_size", "num_heads")
    mine = family_sizes(arch).get(size)
    if mine is None:
        return None
    return next((name for name, other in family_sizes("bert").items()
                 if all(other[k] == mine[k] for k in shape)), None)


def add_arch_ratios(rows: list[dict], name: str = "objective", size: str = "preset",
                    match: Sequence[str] = ARCH_MATCH) -> list[str]:
    """`tokens_vs_bert` = a non-BERT row's tokens/s / the tokens/s of the BERT row with the same `name`
    (objective), the paired size (`bert_partner_size`) and the same `match` fields; `mfu_vs_bert` the
    same with MFU. A row without such a partner (no BERT row of its shape, or the partner failed) gets
    None, never a ratio to another configuration. BERT rows get None. Returns one printable line per ratio."""
    def key(row: dict, row_size: Optional[str]) -> tuple:
        return (row.get(name), row_size) + tuple(row.get(k) for k in match)

    bert = {key(r, r.get(size)): r for r in rows if r.get("arch", "bert") == "bert" and r.get("tokens_per_s")}
    lines = []
    for row in rows:
        arch = row.get("arch", "bert")
        partner = None if arch == "bert" else bert.get(key(row, bert_partner_size(arch, row.get(size))))
        ours = row.get("tokens_per_s")
        row["tokens_vs_bert"] = ours / partner["tokens_per_s"] if partner and ours else None
        row["mfu_vs_bert"] = row["mfu"] / partner["mfu"] if partner and row.get("mfu") and partner.get("mfu") else None
        if row["tokens_vs_bert"] is not None:
            lines.append(f"{arch} {row.get(name)} {row.get(size)} vs bert {partner.get(size)} "
                         + " ".join(f"{k}={row.get(k)}" for k in match)
                         + f": {ours:.0f} / {partner['tokens_per_s']:.0f} tokens/s = {row['tokens_vs_bert']:.3f}x"
                         + (f", MFU {row['mfu_vs_bert']:.3f}x" if row["mfu_vs_bert"] is not None else ""))
    return lines
