"""Training metrics: model FLOPs of what actually ran, MFU, throughput, and the writer to the run's trackers.

FLOPs (per training step, all ranks together) follow Megatron-LM's encoder formula (Narayanan et
al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", Sec. 5.1), generalised
to an FFN of size f instead of 4h. One transformer layer on a [B, s] input, forward:

    2 B s (4 h^2 + 2 h f)      Q, K, V, output projections and the two FFN matmuls
  + 4 B s^2 h                  attention scores Q K^T and the weighted sum with V

counted on what the layers really process: a padded batch unpadded for variable-length attention
(`pipeline.model.attention`) processes T = sum_b s_b tokens, so it counts 2 T (4 h^2 + 2 h f) +
4 h sum_b s_b^2 (`layer_work_flops`); dense and masked passes count the full B x s.

The MLM head is counted only on the rows it is applied to (the predicted positions):
`2 N h E` for the transform and `2 N E C` for the tied projection, where E is the embedding width
(h unless `model.embedding_size` factorises the embeddings) and C the vocabulary size,
or K + 1 for a sampled softmax that scores K negatives (BERT-NCE). Training costs 3x the forward
(backward = 2x) for passes that build a graph, 1x for no-grad passes (COCO-LM's sampling pass).

"Every objective's extra passes counted" is done by measurement rather than by bookkeeping: forward
hooks on every `BertLayerStack` (main encoder, COCO-LM's generator; `ModernBertLayerStack` for
`model.arch=modernbert`, counted by its own `pass_flops`), `PredictionHeadTransform` and
`TiedVocabProjection` add up the formula for each call with its real shapes, so CAPT's second
encoder pass, COCO-LM's generator + crop passes and InfoWord's n-gram pass are all included with
no per-objective code. Embedding lookups, small objective heads (CAPT's aggregation MLP, TACO's
similarities) and metric-only computations are not counted: they are < 1% at base size.

MFU = counted FLOPs / (step time x world size x peak FLOPs of one device), with the peak looked up
by device name and precision (`PEAK_FLOPS`); no MFU on CPU or unknown devices.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from pipeline.io import write_atomic
from pipeline.model.encoder import BertLayerStack
from pipeline.model.heads import PredictionHeadTransform, TiedVocabProjection
from pipeline.model.modernbert import ModernBertHeadTransform, ModernBertLayerStack
from pipeline.train.trackers import RunIdentity, TrackerSet, open_identity, scalars_of

log = logging.getLogger(__name__)


def layer_work_flops(tokens: int, sum_sq_len: int, hidden: int, ffn: int) -> float:
    """Forward FLOPs of one post-LN transformer layer over `tokens` tokens in sequences whose squared
    lengths sum to `sum_sq_len`: 2 T (4 h^2 + 2 h f) + 4 h sum_b s_b^2."""
    return 2.0 * tokens * (4 * hidden * hidden + 2 * hidden * ffn) + 4.0 * sum_sq_len * hidden


def layer_forward_flops(batch: int, seq: int, hidden: int, ffn: int) -> float:
    """Forward FLOPs of one post-LN transformer layer on a [batch, seq] input (formula above)."""
    return layer_work_flops(batch * seq, batch * seq * seq, hidden, ffn)


def mlm_step_flops(batch: int, seq: int, hidden: int, ffn: int, layers: int, predicted: int, vocab: int,
                   embedding: Optional[int] = None) -> float:
    """Training FLOPs of one BERT MLM micro-batch, Megatron-style with the head on the predicted rows only:

        3 [ layers (2 B s (4 h^2 + 2 h f) + 4 B s^2 h) + 2 N h E + 2 N E V ]

    (N predicted rows, V vocabulary, E = `embedding` the tied embeddings' width, default h; backward = 2x
    forward; the factorised embeddings' projection E -> h, like the lookups, is not counted). What
    `FlopCounter` counts for an MLM step of our model; applied to any implementation of the same model
    (the Hugging Face baseline of `benchmarks/throughput/bench_throughput.py`), it gives MFU on the same
    useful work.
    """
    width = embedding or hidden
    return 3.0 * (layers * layer_forward_flops(batch, seq, hidden, ffn) + 2.0 * predicted * hidden * width
                  + 2.0 * predicted * width * vocab)


def _needs_backward(module: nn.Module, inputs: tuple) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return True
    return any(p.requires_grad for p in module.parameters(recurse=False))


class FlopCounter:
    """Adds up training FLOPs of the hooked modules' forward calls (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.flops = 0.0
        self._handles = []
        for module in model.modules():
            if isinstance(module, (BertLayerStack, ModernBertLayerStack, PredictionHeadTransform, ModernBertHeadTransform,
                                   TiedVocabProjection)):
                self._handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module: nn.Module, inputs: tuple, _output: Any) -> None:
        factor = 3.0 if _needs_backward(module, inputs) else 1.0
        x = inputs[0]
        if isinstance(module, BertLayerStack):
            tokens, sum_sq = module.last_work  # what the pass processed (unpadded passes: fewer tokens)
            ffn = module.layer[0].intermediate.dense.out_features
            self.flops += factor * len(module.layer) * layer_work_flops(tokens, sum_sq, x.shape[-1], ffn)
        elif isinstance(module, ModernBertLayerStack):  # model.arch=modernbert: GeGLU, windowed local layers
            self.flops += factor * module.last_flops
        elif isinstance(module, (PredictionHeadTransform, ModernBertHeadTransform)):
            rows, width = x.reshape(-1, x.shape[-1]).shape  # dense h -> E, or H_G -> E (a narrower generator)
            self.flops += factor * 2.0 * rows * width * _output.shape[-1]
        else:  # TiedVocabProjection(hidden, fn, *args): a full softmax, or K sampled negatives
            rows, hidden = x.reshape(-1, x.shape[-1]).shape
            columns = module.bias.shape[0]
            for arg in inputs[2:]:
                if isinstance(arg, torch.Tensor) and arg.dim() == 2 and arg.shape[0] == rows and not arg.is_floating_point():
                    columns = arg.shape[1] + 1  # sampled softmax: target + K negative ids per row
            self.flops += factor * 2.0 * rows * hidden * columns

    def pop(self) -> float:
        """FLOPs counted since the last call (this rank only)."""
        flops, self.flops = self.flops, 0.0
        return flops

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


#: Dense peak FLOP/s of one device from the vendors' datasheets (no sparsity), by precision.
#: "tf32" is used for fp32 runs when torch allows TF32 matmuls. Matched by substring of the
#: device name, first match wins (so the more specific names come first).
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("MI300X", {"bf16": 1307.4e12, "fp16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    ("MI250X", {"bf16": 383e12, "fp16": 383e12, "fp32": 47.9e12}),
]


def peak_flops(device_name: str, precision: str, tf32: bool = False) -> Optional[float]:
    """Peak FLOP/s of one device for `precision` (fp32/bf16/fp16), or None when unknown."""
    key = "tf32" if precision == "fp32" and tf32 else precision
    for pattern, table in PEAK_FLOPS:
        if pattern in device_name:
            return table.get(key)
    return None


def device_peak_flops(precision: str) -> Optional[float]:
    """Peak of the current CUDA device (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    return peak_flops(torch.cuda.get_device_name(), precision, torch.backends.cuda.matmul.allow_tf32)


def peak_memory_gb() -> dict[str, float]:
    """Peak allocated accelerator memory (GiB), or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return {"peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_gb": rss / (2**30 if sys.platform == "darwin" else 2**20)}


class ThroughputMeter:
    """Samples, tokens and FLOPs since the last report, turned into rates over the wall time."""

    def __init__(self, world_size: int, peak: Optional[float]) -> None:
        self.world_size, self.peak = world_size, peak
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.steps = 0
        self.samples = 0
        self.tokens = 0
        self.flops = 0.0

    def add_step(self, samples: int, tokens: int, flops: float) -> None:
        """One optimizer step: global samples, global non-pad tokens, global FLOPs."""
        self.steps += 1
        self.samples += samples
        self.tokens += tokens
        self.flops += flops

    def report(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = {
            "step_time_s": elapsed / max(self.steps, 1),
            "samples_per_s": self.samples / elapsed,
            "tokens_per_s": self.tokens / elapsed,
            "tflops_per_device": self.flops / elapsed / self.world_size / 1e12,
        }
        if self.peak:
            out["mfu"] = self.flops / elapsed / self.world_size / self.peak
        self.reset()
        return out


class MetricsWriter:
    """Rank-0 writer of each logged step's metrics to the run's trackers (`pipeline.train.trackers`):
    `<output_dir>/metrics.jsonl` (one object per logged step; tracker `jsonl`), TensorBoard, W&B, MLflow.

    On resume from step S, lines of steps > S (written by the interrupted run after its last
    checkpoint, possibly a torn last line) are dropped first, and TensorBoard purges events after
    S, so the files of a resumed run read like those of an uninterrupted one; W&B and MLflow continue
    the same tracker run. A failing tracker is dropped with one warning (`TrackerSet`); only the
    JSONL file, which resume and `cpt-status` read, fails the run like any other output.
    """

    def __init__(self, output_dir: str | os.PathLike, enabled: bool, resume_step: int, tensorboard: bool = True,
                 trackers: Optional[Sequence[str]] = None, identity: Optional[RunIdentity] = None) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        names = list(trackers) if trackers is not None else ["tensorboard", "jsonl"] if tensorboard else ["jsonl"]
        self.trackers = TrackerSet([])
        self._fh = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if "jsonl" in names:
            truncate_jsonl(self.path, resume_step)
            self._fh = open(self.path, "a", encoding="utf-8")
        self.trackers = TrackerSet.open(names, identity or RunIdentity(Path(output_dir)), resume_step)

    @classmethod
    def for_run(cls, cfg: Any, enabled: bool, resume_step: int, recipe: Optional[dict] = None,
                rewound: bool = False) -> "MetricsWriter":
        """The writer of a run (`cfg`: its `RunConfig`): `train.trackers` (less `tensorboard` when
        `train.tensorboard=false`), named and tagged from `train.tracker_*`, config + recipe attached;
        `rewound` (a resume from an older tag): new W&B / MLflow runs linked to their parents."""
        identity = open_identity(cfg.train.output_dir, cfg.to_dict(), recipe, cfg.train, cfg.name)
        identity.rewound_to = resume_step if rewound else None
        return cls(cfg.train.output_dir, enabled, resume_step, trackers=cfg.train.active_trackers(), identity=identity)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._fh is not None:
            record = {"step": step, **metrics}
            self._fh.write(json.dumps(record, sort_keys=True) + "\n")
            self._fh.flush()
        self.trackers.log(step, scalars_of(metrics))

    def close(self, outcome: str = "finished") -> None:
        """`outcome`: how the run ended (`pipeline.train.trackers.OUTCOMES`), for W&B's and MLflow's run state."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.trackers.close(outcome)


def read_jsonl(path: str | os.PathLike, skipped: Optional[list[str]] = None) -> list[dict]:
    """The JSON-object records of a metrics file, in order. A line that is not one is skipped: a torn
    last line (a writer killed mid-line: the file does not end with a newline) silently, any other
    (a bare number, invalid UTF-8, a line cut by a damaged disk) with a description appended to
    `skipped` when given ("line 7: not a JSON object (5)"), so a reader can report it and go on."""
    records: list[dict] = []
    p = Path(path)
    if not p.is_file():
        return records
    data = p.read_bytes()
    lines = data.splitlines()
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            problem = "" if isinstance(record, dict) else f"not a JSON object ({raw[:40].decode('utf-8')!s})"
        except UnicodeDecodeError as err:
            problem = f"invalid UTF-8 (byte {err.start + 1})"
        except json.JSONDecodeError as err:
            if number == len(lines) and not data.endswith(b"\n"):
                continue  # torn by a writer caught mid-line: not damage, the next write completes it
            problem = f"not JSON ({err.msg} at column {err.colno})"
        if problem:
            if skipped is not None:
                skipped.append(f"line {number}: {problem}")
            continue
        records.append(record)
    return records


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only records with step <= last_step (atomic rewrite; nothing to do if none is dropped);
    lines that are not records are dropped too, each reported in one warning."""
    if not path.is_file():
        return
    skipped: list[str] = []
    records = read_jsonl(path, skipped)
    kept = [r for r in records if not isinstance(r.get("step"), (int, float)) or r["step"] <= last_step]
    if skipped:
        log.warning("%s: %d line(s) that are not metrics records dropped on resume (%s)", path, len(skipped),
                    "; ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    if len(kept) == len(path.read_bytes().splitlines()):
        return
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
