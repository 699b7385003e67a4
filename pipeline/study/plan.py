"""`cpt-study plan`: the jobs a study submits and their estimated GPU-hours, before anything is queued.

GPU-seconds of one pretraining run, at the run's sequence length and vocabulary: the training shards'
manifest's when it is there, else the objective's `data.seq_len` (preset and overrides), else the study's
`cost.seq_len` / `cost.vocab_size`, else 128 / 30522, which the plan then prints as ASSUMED:

* with a measured rate (`cost.tokens_per_s.<objective>`: tokens/s per GPU, e.g. from
  `benchmarks/throughput` or a run's metrics): steps x global batch x seq_len / rate;
* otherwise from FLOPs: steps x `pipeline.train.metrics.mlm_step_flops` (Megatron's encoder formula,
  the one the training MFU uses, with 15% of the tokens predicted) x `cost.flops_factor.<objective>`
  (default 1: an objective's extra passes, e.g. COCO-LM's generator or CAPT's second view, are
  counted only through this factor) / (the device's dense peak `peak_flops(cost.device, precision)`
  x `cost.mfu`, default 0.4).

Fine-tuning (every task, fine-tuning seed and evaluation point that the study fine-tunes) is
estimated the same way (3 x forward FLOPs of `train_examples x epochs` sequences of 128 tokens);
held-out metrics and conversion are not counted (seconds each).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.study.spec import Study, StudyError, run_config

#: fraction of tokens BERT's masking predicts; fine-tuning sequence length assumed by the estimate
MASK_FRACTION, FINETUNE_SEQ = 0.15, 128


#: what the estimate takes when nothing says (BERT's vocabulary, the study presets' usual sequence length); a plan
#: that uses either says so
ASSUMED_VOCAB, ASSUMED_SEQ = 30522, 128


def _vocab_and_seq(study: Study, cfg, objective: str) -> tuple[int, int, str, str]:
    """(vocab size, seq_len, where each came from): the training shards' manifest when it is there, else the
    objective's preset and overrides (`data.seq_len`), else the study's `cost.vocab_size` / `cost.seq_len`,
    else `ASSUMED_VOCAB` / `ASSUMED_SEQ` ("assumed")."""
    manifest = study.shards["train"] / "manifest.json"
    m = json.loads(manifest.read_text()) if manifest.is_file() else {}
    if m.get("vocab_size"):
        vocab, vocab_from = int(m["vocab_size"]), "the shards' manifest"
    elif study.cost.get("vocab_size"):
        vocab, vocab_from = int(study.cost["vocab_size"]), "cost.vocab_size"
    else:
        vocab, vocab_from = ASSUMED_VOCAB, "assumed"
    if m.get("seq_len"):
        seq, seq_from = int(m["seq_len"]), "the shards' manifest"
    elif cfg.data.seq_len:  # the preset's or the objective's overrides' (None: the shards' own)
        seq, seq_from = int(cfg.data.seq_len), f"objectives.{objective} data.seq_len"
    elif study.cost.get("seq_len"):
        seq, seq_from = int(study.cost["seq_len"]), "cost.seq_len"
    else:
        seq, seq_from = ASSUMED_SEQ, "assumed"
    return vocab, seq, vocab_from, seq_from


def plan(study: Study) -> dict[str, Any]:
    """Jobs and estimated GPU-hours per objective and in total."""
    from pipeline.train.metrics import layer_forward_flops, mlm_step_flops, peak_flops

    mfu = float(study.cost.get("mfu", 0.4))
    device = str(study.cost.get("device", "H100"))
    rates = study.cost.get("tokens_per_s") or {}
    factors = study.cost.get("flops_factor") or {}
    n_lr, n_seed, n_task = len(study.lrs), len(study.seeds), len(study.tasks)
    n_ft = len(study.finetune["seeds"])
    rows, total_pre, total_ft = [], 0.0, 0.0
    for name in study.objectives:
        cfg = run_config(study, name)
        shape = cfg.model.shape()
        vocab, seq, vocab_from, seq_from = _vocab_and_seq(study, cfg, name)
        batch, steps = cfg.data.global_batch_size, study.steps_of[name]
        precision = cfg.deepspeed.precision
        peak = peak_flops(device, precision, tf32=bool(cfg.deepspeed.tf32))
        if not peak:
            raise StudyError(f"{study.path}: cost.device: no peak FLOP/s known for {device!r} in {precision}")
        tokens = steps * batch * seq
        if name in rates:
            run_s, how = tokens / float(rates[name]), f"measured {float(rates[name]):,.0f} tokens/s per GPU"
        else:
            flops = steps * mlm_step_flops(batch, seq, shape["hidden_size"], shape["ffn_size"], shape["num_layers"],
                                           round(MASK_FRACTION * batch * seq), vocab,
                                           cfg.model.embedding_size) * float(factors.get(name, 1.0))
            run_s, how = flops / (peak * mfu), f"FLOPs x {float(factors.get(name, 1.0)):g} at MFU {mfu:g} of {device} {precision}"
        runs = n_lr + n_seed - 1
        points = len(study.eval_steps(name))
        # fine-tunings: sweep runs at their last point, selected runs at every point (the sweep seed's last
        # one is the sweep's) and once with test; the random-init floor beside MLM's first seed
        finetunes = n_task * n_ft * (n_lr + n_seed * points - 1 + n_seed) + (n_task * n_ft if name == "mlm" else 0)
        ft_flops = sum(3.0 * shape["num_layers"] * layer_forward_flops(t.train_examples * int(study.finetune["epochs"]),
                                                                        FINETUNE_SEQ, shape["hidden_size"],
                                                                        shape["ffn_size"]) for t in study.tasks)
        ft_s = (finetunes / max(n_task, 1)) * ft_flops / (peak * mfu) if n_task else 0.0
        rows.append({"objective": name, "preset": study.objectives[name].preset, "steps": steps,
                     "tokens_per_run": tokens, "runs": runs, "gpu_hours_per_run": run_s / 3600.0,
                     "pretrain_gpu_hours": runs * run_s / 3600.0, "eval_points": points, "finetunes": finetunes,
                     "finetune_gpu_hours": ft_s / 3600.0, "estimate": how, "seq_len": seq, "seq_len_from": seq_from,
                     "vocab_size": vocab, "vocab_size_from": vocab_from,
                     "shape": f"{shape['num_layers']}x{shape['hidden_size']}, seq {seq}{' (ASSUMED)' if seq_from == 'assumed' else ''}, "
                              f"batch {batch}"})
        total_pre += runs * run_s
        total_ft += ft_s
    n_obj = len(study.objectives)
    array_tasks = sum(len(study.eval_steps(o)) * (n_lr + n_seed) - 1 for o in study.objectives)
    jobs = {"pretrain": n_obj * (n_lr + n_seed - 1), "eval_arrays": n_obj * (n_lr + n_seed),
            "eval_array_tasks": array_tasks, "driver": 1, "final": 1}
    return {"study": str(study.path), "world_size": study.world_size, "rows": rows, "jobs": jobs,
            "job_count": jobs["pretrain"] + jobs["eval_arrays"] + 2,
            "data": {**{k: str(v) for k, v in study.shards.items()}, **{f"task {t.name}": str(t.dir) for t in study.tasks},
                     **({"sts": str(study.sts.dir)} if study.sts else {})},
            "sts": study.sts.record() if study.sts else None,
            "pretrain_gpu_hours": total_pre / 3600.0, "finetune_gpu_hours": total_ft / 3600.0,
            "gpu_hours": (total_pre + total_ft) / 3600.0}


def format_plan(p: dict[str, Any]) -> str:
    lines = [f"study {p['study']}: {p['world_size']} GPU(s) per pretraining job"]
    for r in p["rows"]:
        lines.append(f"  {r['objective']:<10} {r['preset']:<16} {r['shape']}, {r['steps']} steps "
                     f"({r['tokens_per_run'] / 1e9:.3g}B tokens) x {r['runs']} runs: {r['gpu_hours_per_run']:.4g} "
                     f"GPU-h per run ({r['estimate']}) = {r['pretrain_gpu_hours']:.4g} GPU-h; {r['eval_points']} "
                     f"evaluation points{' (zero-shot STS-B at each)' if p.get('sts') else ''}, {r['finetunes']} fine-tunings {r['finetune_gpu_hours']:.3g} GPU-h")
    j = p["jobs"]
    lines.append(f"jobs: {p['job_count']} ({j['pretrain']} pretraining, {j['eval_arrays']} evaluation arrays with "
                 f"{j['eval_array_tasks']} tasks, 1 driver, 1 final)")
    lines.append(f"estimated GPU-hours: {p['gpu_hours']:.4g} (pretraining {p['pretrain_gpu_hours']:.4g}, "
                 f"fine-tuning {p['finetune_gpu_hours']:.3g}; queue time and held-out evaluation not counted)")
    why = {"seq_len": f"ASSUMED seq_len {ASSUMED_SEQ} for {{}}: no shards' manifest at shards.train yet, no data.seq_len "
                      "in the preset or overrides, no cost.seq_len; the estimate scales with it: set cost.seq_len to the "
                      "shards' --seq-len",
           "vocab_size": f"ASSUMED vocab_size {ASSUMED_VOCAB} for {{}}: no shards' manifest at shards.train yet, no "
                         "cost.vocab_size: set cost.vocab_size to the tokenizer's size"}
    for key in ("seq_len", "vocab_size"):
        assumed = [r["objective"] for r in p["rows"] if r[f"{key}_from"] == "assumed"]
        if assumed:
            lines.append(why[key].format(", ".join(assumed)))
        else:
            lines.append(f"{key}: " + "; ".join(sorted({f"{r[key]} from {r[key + '_from']}" for r in p["rows"]})))
    lines.append("data (as written; checked at submit): " + ", ".join(f"{k} {v}" for k, v in p["data"].items()))
    return "\n".join(lines)


def write_plan(p: dict[str, Any], path: Path) -> None:
    from pipeline.report_files import write_json

    write_json(path, p)
