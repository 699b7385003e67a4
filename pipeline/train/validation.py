"""Validation during training: every term the objectives log, measured on held-out data every
`eval.every` steps (Megatron's `--eval-interval`, the HF Trainer's `eval_steps`).

What one evaluation measures (`Validator.evaluate`, logged as `val/<term>`):

* every metric the run's forward logs on a logged training step — each objective's loss terms and
  learning signals with their `_chance` levels, and the health references (`val/health/unigram_accuracy`,
  the plateau; `val/health/unigram_entropy`) — so `pipeline.monitor.signals.learning_signals` pairs each
  `val/` term with its chance level exactly as it pairs the training ones;
* for a run whose objectives train the shared MLM head (`Objective.mlm_head`), the masked LM that head
  is, on the held-out masked positions (`masked` view: BERT's selection and 80/10/10):
  `val/mlm_head/accuracy` = correct / N and `val/mlm_head/loss` = sum -log softmax(z + o)_t / N over
  all ranks' N positions, with o = log q when only sampled-softmax objectives (BERT-NCE, InfoWord)
  train the head (the masked LM conversion exports, `pipeline.export.hf_adapter.head_bias_correction`),
  else o = 0: one yardstick across objectives.

Each value is the mean over the `eval.batches` micro-batches of every rank (one all-reduce per
evaluation, `pipeline.distributed.all_reduce_sum`); the head yardstick is weighted by positions.
One number per quantity: where an objective's own loss *is* the yardstick (`mlm` on the head's view,
a full softmax with no log-q offset: the same positions, targets and logits), its `val/<name>/loss`
and `val/<name>/accuracy` are the yardstick's position-weighted values (sum over all masked positions
/ N: the loss of the set, not a mean of micro-batch means, which weighs a micro-batch with few masked
positions like one with many and so differs in the 4th decimal), and `val/loss` is sum_o w_o
`val/<o>/loss` again; an MLM-only run thus logs one validation loss under all three names.

The set's identity. Every `val/` record carries `eval_set` (`eval_set_identity`): a digest of the
held-out shards' content hash and of what picks and corrupts the evaluated sequences (`eval.seed`,
the evaluation micro-batch size, the number of micro-batches over all ranks, `data.corruption`).
Values of two identities were measured on different sequences and are never compared:
`validation_summary` (what `cpt-status`, the model card and checkpoints report) takes the latest and
best values over the evaluations of the latest set only and counts the others, and the best
checkpoint (`train.keep_best`) starts a new lineage when a resume changes the set
(`pipeline.train.checkpoint.best_resume`).

Fixed corruption. The held-out rows are visited in the order `epoch_permutation(eval.seed, 0, N)`;
micro-batch b of rank r reads positions (b x world + r) x micro ... + micro, and the collator and the
objectives' sampling streams are keyed by (eval.seed, position) (`pipeline.seeding`), so every
evaluation of a run, and of every run on the same set with the same `eval.micro_batch_size`, sees the
same sequences with the same masks, spans, crops and negatives; the collated batches are built once.

Nothing leaks into training: the model runs in eval mode (no dropout) under `no_grad`; torch's, numpy's
and `random`'s global generators are saved and restored (training reseeds dropout before every step
anyway, `seeding.reseed_dropout`); the objectives' buffers and host scalars are restored after it
(CAPT's memory queue is never enqueued outside training, `capt.py`; COCO-LM's replacements draw from
the evaluation's own stream); the FLOPs of the evaluation passes are dropped from the step counter and
the throughput window restarts, so a run with validation trains bit for bit as one without (a test).
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline import seeding
from pipeline.data.batch import VIEW_INPUTS, VIEW_LABELS, gather_selected, move_batch, positions_key, seqlens_key
from pipeline.distributed import all_reduce_sum
from pipeline.train.eval_config import EvalConfig
from pipeline.monitor.signals import format_signal, format_signals, learning_signals
from pipeline.objectives.base import SAMPLED_SOFTMAX, StepProgress
from pipeline.objectives.registry import mlm_head_training

log = logging.getLogger(__name__)
PREFIX = "val/"
HEAD_KEY = "mlm_head"
#: The key of every validation record that names the set its values were measured on (module doc).
EVAL_SET_KEY = "eval_set"


def eval_set_identity(content_hash: str, seed: int, micro: int, micro_batches: int, corruption: dict) -> str:
    """16 hex digits naming what an evaluation measures (module doc): the held-out shards' content hash,
    `eval.seed`, the micro-batch size, the micro-batches over all ranks and the corruption settings."""
    blob = json.dumps({"content_hash": content_hash, "seed": seed, "micro": micro, "micro_batches": micro_batches,
                       "corruption": corruption}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Validator:
    """This rank's slice of the held-out set, collated once, and the evaluation over it."""

    def __init__(self, cfg: EvalConfig, dataset: Any, model: Any, corruption: dict, rank: int, world_size: int,
                 train_micro: int, device: torch.device) -> None:
        from pipeline.data.corruption import CorruptionCollator

        self.cfg, self.dataset, self.rank, self.world_size, self.device = cfg, dataset, rank, world_size, device
        self.micro = cfg.micro_batch(train_micro)
        self.batches = min(cfg.batches, len(dataset) // (self.micro * world_size))
        if self.batches < cfg.batches and rank == 0:
            log.warning("eval.batches=%d: %s holds %d sequences, enough for %d evaluation batch(es) of %d x %d rank(s); "
                        "evaluating on those", cfg.batches, cfg.shards_dir, len(dataset), self.batches, self.micro,
                        world_size)
        training = {n: how for n, how in mlm_head_training(model.objectives).items() if model.weights.get(n, 1.0) != 0}
        self.head = bool(training)
        views = set(model.views)
        masked = [v for v in ("masked", "wwm_masked") if v in views]
        self.head_view = masked[0] if masked else "masked"
        if self.head:
            views.add(self.head_view)
        #: log q of the sampled-softmax head (added to its scores) when no full-softmax objective trains it
        self.offset_owner = None
        if self.head and all(how == SAMPLED_SOFTMAX for how in training.values()):
            from pipeline.objectives.mlm_nce import log_proposal_samplers

            self.offset_owner = next(iter(log_proposal_samplers(model).values()), None)
        self.collator = CorruptionCollator(views, dataset.special_tokens, dataset.vocab_size, cfg.seed,
                                           plans=model.host_plans(), **corruption)
        #: objectives whose own loss is the head's yardstick (module doc: reported as one number)
        self.yardstick_objectives = [
            name for name, objective in model.objectives.items()
            if self.head and self.offset_owner is None and getattr(objective, "name", "") == "mlm"
            and tuple(objective.views) == (self.head_view,) and model.weights.get(name, 1.0) != 0]
        self.weights = {name: float(model.weights.get(name, 1.0)) for name in model.objectives}
        from pipeline.data.shards import manifest_hash

        self.identity = eval_set_identity(manifest_hash(dataset.directory), cfg.seed, self.micro,
                                          self.batches * world_size, corruption)
        self._host_batches: Optional[list[dict[str, Tensor]]] = None
        #: this run's evaluation records so far (`validation_summary`); None until `remember` first reads the file
        self.history: Optional[list[dict]] = None

    def remember(self, record: dict, metrics_file: Any) -> dict[str, Any]:
        """Add an evaluation's record to the run's history and return the run's `validation_summary`. The
        history starts from the run's `metrics.jsonl` (a resumed run's evaluations before its checkpoint:
        the writer truncated the file to that step), so the best values survive a preemption."""
        if self.history is None:
            from pipeline.train.metrics import read_jsonl

            self.history = [r for r in read_jsonl(metrics_file) if is_validation_record(r)
                            and isinstance(r.get("step"), int) and r["step"] < record["step"]]
        self.history.append(record)
        return validation_summary(self.history)

    def due(self, step: int, total_steps: int) -> bool:
        return self.cfg.due(step, total_steps)

    def host_batches(self) -> list[dict[str, Tensor]]:
        """This rank's evaluation micro-batches (module doc), collated on first use."""
        if self._host_batches is None:
            order = seeding.epoch_permutation(self.cfg.seed, 0, len(self.dataset))
            batches = []
            for b in range(self.batches):
                first = (b * self.world_size + self.rank) * self.micro
                positions = np.arange(first, first + self.micro, dtype=np.int64)
                ids, starts = self.dataset.take(order[positions])
                batches.append(self.collator.collate(ids, starts, positions))
            self._host_batches = batches
        return self._host_batches

    def evaluate(self, engine: Any, model: Any, step: int, total_steps: int, micro_batches: int) -> dict[str, float]:
        """Collective: the `val/` metrics of the model as it is after step `step` (module doc).
        `micro_batches`: the training step's ranks x accumulation (the scale of a sum-reduced loss)."""
        progress = StepProgress(step, total_steps, micro_batches, record_metrics=True)
        sums: dict[str, Tensor] = {}
        head = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, positions
        was_training = model.training
        with preserved_state(model):
            engine.eval()
            try:
                with torch.no_grad():
                    for batch in self.host_batches():
                        seed = seeding.sampling_seed(self.cfg.seed, int(batch["sample_index"][0]))
                        on_device = move_batch(batch, self.device)
                        _, parts = engine(on_device, progress, seed)
                        for key, value in parts.items():
                            sums[key] = sums.get(key, 0.0) + value.detach().double()
                        if self.head:
                            head += self.head_scores(model, on_device)
            finally:
                engine.train(was_training)
        keys = sorted(sums)
        values = all_reduce_sum(torch.cat([torch.stack([sums[k].reshape(()) for k in keys]).to(self.device), head]))
        count = self.batches * self.world_size
        out = {f"{PREFIX}{k}": v / count for k, v in zip(keys, values[: len(keys)].tolist())}
        loss_sum, correct, positions = values[len(keys):].tolist()
        if self.head and positions:
            out[f"{PREFIX}{HEAD_KEY}/loss"] = loss_sum / positions
            out[f"{PREFIX}{HEAD_KEY}/accuracy"] = correct / positions
            out[f"{PREFIX}{HEAD_KEY}/positions"] = positions
            for name in self.yardstick_objectives:  # one number (module doc)
                out[f"{PREFIX}{name}/loss"] = out[f"{PREFIX}{HEAD_KEY}/loss"]
                if f"{PREFIX}{name}/accuracy" in out:
                    out[f"{PREFIX}{name}/accuracy"] = out[f"{PREFIX}{HEAD_KEY}/accuracy"]
            if self.yardstick_objectives and all(f"{PREFIX}{n}/loss" in out for n in self.weights):
                out[f"{PREFIX}loss"] = sum(w * out[f"{PREFIX}{n}/loss"] for n, w in self.weights.items())
        return out

    def head_scores(self, model: Any, batch: dict[str, Tensor]) -> Tensor:
        """(sum of -log softmax(z + o)_t, correct argmaxes, positions) of the shared MLM head at this
        batch's masked positions, float64 [3]; the logits [N, V] are fp32 (N: this micro-batch's positions)."""
        ids_key, mask_key = VIEW_INPUTS[self.head_view]
        labels_key = VIEW_LABELS[self.head_view]
        hidden = model.bert(batch[ids_key], batch[mask_key], seqlens=batch.get(seqlens_key(mask_key))).last_hidden
        h_sel, targets, _ = gather_selected(hidden, batch[labels_key], batch.get(positions_key(labels_key)))
        offset = self.offset_owner.log_proposal if self.offset_owner is not None else None
        return model.cls(h_sel, _scored, targets, offset)


def _scored(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
            offset: Optional[Tensor]) -> Tensor:
    """The head's projection as a full-softmax masked LM: [sum CE, correct, N] (float64)."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    if offset is not None:
        logits = logits + offset.float()
    if targets.numel() == 0:
        return torch.zeros(3, dtype=torch.float64, device=hidden.device)
    loss = F.cross_entropy(logits, targets, reduction="sum")
    correct = (logits.argmax(-1) == targets).sum()
    return torch.stack([loss.double(), correct.double(), torch.tensor(float(targets.numel()), dtype=torch.float64,
                                                                      device=hidden.device)])


class preserved_state:
    """Context manager: torch's (CPU and CUDA), numpy's and `random`'s global generator states, and every
    objective module's buffers and host scalars (bool / int / float attributes), as they were on entry."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                    np.random.get_state(), random.getstate())
        self.modules = list(self.model.objectives.modules())
        self.buffers = [{k: b.clone() for k, b in m._buffers.items() if b is not None} for m in self.modules]
        self.scalars = [{k: v for k, v in vars(m).items() if isinstance(v, (bool, int, float))} for m in self.modules]

    def __exit__(self, *exc: Any) -> None:
        cpu, cuda, numpy_state, python_state = self.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        with torch.no_grad():
            for module, buffers, scalars in zip(self.modules, self.buffers, self.scalars):
                for key, saved in buffers.items():
                    module._buffers[key].copy_(saved)
                for key, value in scalars.items():
                    if key != "training":  # restored by engine.train(...)
                        setattr(module, key, value)


def open_validator(cfg: Any, plan: Any, model: Any, rank: int, world_size: int,
                   device: torch.device) -> Optional[Validator]:
    """The run's `Validator` (`cfg`: its `RunConfig`), every rank checking the held-out shards' bytes as
    training's are checked (`open_dataset`); None when `eval.shards_dir` is unset."""
    if getattr(plan, "eval_manifest", None) is None:
        return None
    from pipeline.data.reader import open_dataset

    # the run's own data.* (not a phase's view): the same evaluation batches in every phase and after a resume
    root = getattr(plan.schedule, "root", None) or cfg
    dataset = open_dataset(cfg.eval.shards_dir, cfg.data.verify_shards, where="eval.shards_dir")
    return Validator(cfg.eval, dataset, model, dict(root.data.corruption), rank, world_size,
                     root.data.micro_batch_size, device)


def validate(run: Any, step: int) -> dict[str, Any]:
    """Collective, the training loop's hook (`run`: its `Run`): evaluate after step `step`, write the
    `val/` metrics and the set's identity (`EVAL_SET_KEY`) through the run's `MetricsWriter` (its own
    record at that step), log them on one line
    beside their chance levels, and keep the evaluation out of the next step's FLOPs and throughput."""
    total = run.cfg.train.total_steps
    metrics = {**run.validator.evaluate(run.engine, run.model, step, total,
                                        run.plan.batch.grad_accum * run.info.world_size),
               EVAL_SET_KEY: run.validator.identity}  # the set they were measured on (module doc)
    run.writer.write(step, metrics)
    run.meta.validation = run.validator.remember({"step": step, **metrics}, run.writer.path)  # the checkpoint's meta
    check_best_metric(run.cfg.train.keep_best, metrics)
    if run.checkpointer.observe_metric(step, metrics) and run.info.is_main:  # train.keep_best: saved at this step
        log.info("step %d: new best %s = %.4f", step, run.cfg.train.keep_best, metrics[run.cfg.train.keep_best])
    if run.info.is_main:
        log.info("validation at step %d/%d: loss %.4f%s", step, total, metrics.get(f"{PREFIX}loss", float("nan")),
                 f" | signals {signals}" if (signals := format_signals(val_signals(metrics))) else "")
    run.flop_counter.pop()
    run.meter.reset()
    return metrics


def check_best_metric(name: str, metrics: dict[str, float]) -> None:
    """The backstop of `check_keep_best` (which knows names only by their shape): `train.keep_best` naming a
    `val/` metric that the first evaluation did not log is a `ConfigError` listing the ones it did."""
    from pipeline.config.checks import ConfigError, did_you_mean

    if name.startswith(PREFIX) and name not in metrics:
        raise ConfigError(f"train.keep_best={name}: no evaluation logs it{did_you_mean(name, list(metrics))}; "
                          f"logged: {', '.join(sorted(metrics))}")


def val_signals(metrics: dict[str, Any]) -> list:
    """`learning_signals` of the `val/` metrics (names without the prefix, then with it again)."""
    from dataclasses import replace

    inner = {k[len(PREFIX):]: v for k, v in metrics.items() if k.startswith(PREFIX)}
    return [replace(s, term=PREFIX + s.term, reference_key=PREFIX + s.reference_key)
            if s.kind != "collapse" else replace(s, term=PREFIX + s.term) for s in learning_signals(inner)]


def validation_summary(records: list[dict]) -> dict[str, Any]:
    """What a run's `metrics.jsonl` says of its validation (`cpt-status`, the model card): the latest
    evaluation's step, set (`eval_set`, module doc) and signals, and for `val/loss` and every `val/`
    learning signal its latest value and its best (lowest for a loss, highest for an accuracy / AUC) with
    the step, over the evaluations of the latest set only (`other_set_evaluations`: how many were left
    out, measured on another set; a record without `eval_set` is of an unknown set); {} without any."""
    evaluations = [r for r in records if is_validation_record(r) and isinstance(r.get("step"), int)]
    if not evaluations:
        return {}
    last = evaluations[-1]
    other = [r for r in evaluations if r.get(EVAL_SET_KEY) != last.get(EVAL_SET_KEY)]
    evaluations = [r for r in evaluations if r.get(EVAL_SET_KEY) == last.get(EVAL_SET_KEY)]
    directions = {s.term: s.direction for s in val_signals(last)}
    directions.setdefault(f"{PREFIX}loss", "lower")
    terms = {}
    for term, direction in sorted(directions.items()):
        seen = [(r["step"], float(r[term])) for r in evaluations if isinstance(r.get(term), (int, float))]
        if not seen:
            continue
        # the earliest evaluation among equals: min over (value, step), the value negated when higher is better
        best_step, best = min(seen, key=lambda sv: (sv[1] if direction == "lower" else -sv[1], sv[0]))
        terms[term] = {"latest": seen[-1][1], "best": best, "best_step": best_step, "direction": direction}
    return {"step": last["step"], "evaluations": len(evaluations), EVAL_SET_KEY: last.get(EVAL_SET_KEY, ""),
            "other_set_evaluations": len(other), "terms": terms,
            "signals": [s.to_dict() | {"text": format_signal(s)} for s in val_signals(last)]}


def is_validation_record(record: dict) -> bool:
    """A `metrics.jsonl` record written by an evaluation (`validate`), not by a training step."""
    return any(k.startswith(PREFIX) for k in record)
