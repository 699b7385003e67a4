"""The time-to-quality report: every figure as a mean and a 95% t-interval over pretraining seeds,
every run's health, the baseline's health check, and no speed-up ratio against a baseline that failed it.

Baseline health check (`baseline_health`), on MLM's final checkpoints at the selected learning rate:
  1. not collapsed: every seed's held-out mean token cosine <= `COLLAPSE_COSINE`;
  2. off the unigram plateau: held-out masked accuracy minus the unigram predictor's accuracy at the
     same positions, lower 95% bound over seeds (the mean with a single seed) > `--plateau-margin`;
  3. with SST-2: pretraining must have bought something downstream. MLM's dev accuracy (one value per
     pretraining seed, each the mean over its fine-tuning seeds) minus the randomly initialised
     floor's (one value per fine-tuning seed): Welch's 95% interval of the difference
     (`stats.difference_ci`) must lie above 0. With a single floor value (one fine-tuning seed) its
     spread is unknown, and MLM's lower bound must exceed that value instead (a weaker check, said so).
If any check fails, the report says which and prints no time-to-target step or ratio at all:
those are measured against the baseline's own final quality, which would then mean nothing. A claim stated
against another baseline (`PAPER_BASELINES`: COCO-LM against ELECTRA) is held to the same rule with that
baseline's own health check (the same three checks on its curves: ELECTRA's held-out masked accuracy is
its generator's, its token cosine the discriminator's): an ELECTRA that collapsed (its paper's T = 1
sampling does at small scale, docs/objectives.md) gives no COCO-LM-vs-ELECTRA ratio, whatever MLM did.

With zero-shot STS-B (a study's `sts:`), every point also carries `sts_dev` / `sts_test` (Spearman x 100),
plotted against steps, tokens and device-hours with the floors drawn, and `time_to_quality_sts` compares each
objective with MLM at equal budget and at matched compute (`pipeline.study.sts_comparison`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from pipeline.monitor.health import COLLAPSE_COSINE
from pipeline.report_files import line_chart, write_report
from pipeline.stats import difference_ci, format_ci, mean_ci
from pipeline.study.sts_comparison import comparison_rows, floor_lines, floor_rows, sts_values, verdict as sts_verdict
from pipeline.study.targets import EvalPoint, mean_curve, time_to_target

#: curve metric -> (higher is better, or None for a health number with no target)
METRICS = {"sst2_dev_accuracy": True, "heldout_mlm_acc": True, "heldout_mlm_loss": False,
           "unigram_acc": None, "token_cosine": None, "sts_dev": True, "sts_test": True,
           "sts_test_input_embeddings": None}
PLOTTED = ("sst2_dev_accuracy", "heldout_mlm_acc", "token_cosine", "sts_test")
#: x-axes of the plots (tokens: where every run recorded them)
AXES = ("device_hours", "step", "tokens")


def point_values(point: dict) -> dict[str, float]:
    report = point["heldout"]["report"]
    values = {"heldout_mlm_acc": report["mlm_acc"], "heldout_mlm_loss": report["mlm_loss"],
              "unigram_acc": report["unigram_acc"], "token_cosine": report["token_cosine"]}
    if point.get("downstream"):
        values["sst2_dev_accuracy"] = point["downstream"]["pretrained"]["dev"]["mean"]
    values.update(sts_values(point.get("sts")))
    return values


def curves_of(selected: dict[str, list[dict]]) -> dict[str, dict[int, list[EvalPoint]]]:
    """objective -> seed -> evaluation curve of the selected runs that finished."""
    return {obj: {run["key"].seed: [EvalPoint(p["step"], p["device_hours"], point_values(p), p.get("tokens"))
                                    for p in run["points"]]
                  for run in runs if run["status"] == "ok"} for obj, runs in selected.items()}


def final_of(curve: list[EvalPoint], metric: str) -> Optional[float]:
    return curve[-1].values.get(metric) if curve else None


def baseline_health(curves: dict[int, list[EvalPoint]], floor_dev: Optional[list[float]], margin: float) -> dict:
    """The three checks of the module docstring on MLM's per-seed curves; `passed` and one line each."""
    cosines = [final_of(c, "token_cosine") for c in curves.values()]
    gaps = mean_ci([final_of(c, "heldout_mlm_acc") - final_of(c, "unigram_acc") for c in curves.values()])
    checks = []
    collapsed = [c for c in cosines if c is not None and c > COLLAPSE_COSINE]
    checks.append({"check": "not collapsed", "passed": bool(cosines) and not collapsed,
                   "detail": f"held-out mean token cosine per seed {[round(c, 3) for c in cosines]} "
                             f"(collapsed above {COLLAPSE_COSINE})"})
    bound = gaps["lo"] if gaps["lo"] is not None else gaps["mean"]
    checks.append({"check": "off the unigram plateau", "passed": bound is not None and bound > margin,
                   "detail": f"masked accuracy - unigram accuracy {format_ci(gaps)}; "
                             f"{'lower bound' if gaps['lo'] is not None else 'single seed'} must exceed {margin}"})
    dev = mean_ci([final_of(c, "sst2_dev_accuracy") for c in curves.values()])
    if floor_dev and dev["mean"] is not None:
        floor = mean_ci(floor_dev)
        if len(floor_dev) >= 2:
            gain = difference_ci([final_of(c, "sst2_dev_accuracy") for c in curves.values()], floor_dev)
            passed = gain["lo"] is not None and gain["lo"] > 0.0
            detail = (f"SST-2 dev {format_ci(dev)} vs random-init floor {format_ci(floor)} "
                      f"({len(floor_dev)} fine-tuning seeds): difference {format_ci(gain)} (Welch), "
                      "lower bound must exceed 0")
        else:
            dev_bound = dev["lo"] if dev["lo"] is not None else dev["mean"]
            passed = dev_bound > floor["mean"]
            detail = (f"SST-2 dev {format_ci(dev)} vs random-init floor {floor['mean']:.3f} (one fine-tuning seed: "
                      "the floor's spread is unknown)")
        checks.append({"check": "beats the random-init floor on SST-2", "passed": passed, "detail": detail})
    return {"passed": bool(curves) and all(c["passed"] for c in checks), "checks": checks,
            "seeds": sorted(curves)}


def summary_rows(study: dict, curves: dict, floor: Optional[dict]) -> list[dict]:
    """One row per objective at its selected learning rate: final figures, mean [95% interval]."""
    rows = []
    for objective, by_seed in curves.items():
        runs = study["selected"][objective]
        tests = [(study["final"].get(r["key"].name) or {}).get("pretrained", {}).get("test", {}).get("mean")
                 for r in runs if r["status"] == "ok"]
        finals = {m: mean_ci([final_of(c, m) for c in by_seed.values()]) for m in METRICS}
        gap = mean_ci([final_of(c, "heldout_mlm_acc") - final_of(c, "unigram_acc") for c in by_seed.values()])
        hours = mean_ci([c[-1].device_hours for c in by_seed.values()])
        collapsed_steps = [r["train"]["train_health"]["collapsed_steps"] for r in runs if r["status"] == "ok"]
        positives = [v for r in runs if r["status"] == "ok"
                     for v in r["train"]["train_health"]["positive_cosines"].values()]
        rows.append({
            "objective": objective, "lr": study["selection"][objective]["lr"],
            "seeds": f"{len(by_seed)}/{len(runs)}",
            "sst2_dev": format_ci(finals["sst2_dev_accuracy"]), "sst2_test": format_ci(mean_ci(tests)),
            "heldout_mlm_acc": format_ci(finals["heldout_mlm_acc"]), "unigram_acc": format_ci(finals["unigram_acc"]),
            "acc_minus_unigram": format_ci(gap), "token_cosine": format_ci(finals["token_cosine"]),
            "heldout_mlm_loss": format_ci(finals["heldout_mlm_loss"]), "device_hours": format_ci(hours, 4),
            "train_collapsed_steps": sum(collapsed_steps), "train_positive_cosine": format_ci(mean_ci(positives)),
            **({"sts_dev": format_ci(finals["sts_dev"], 1), "sts_test": format_ci(finals["sts_test"], 1),
                "sts_test_input_embeddings": format_ci(finals["sts_test_input_embeddings"], 1)}
               if finals["sts_test"]["mean"] is not None else {}),
        })
    if floor is not None:
        rows.append({"objective": "random init (floor)", "seeds": f"{len(floor['dev']['seeds'])} fine-tuning",
                     "sst2_dev": format_ci(mean_ci(floor["dev"]["seeds"])),
                     "sst2_test": format_ci(mean_ci(floor.get("test", {}).get("seeds", [])))})
    rows += floor_rows(study["selected"])
    return rows


#: Claims a paper states against a baseline other than MLM, as (objective, its paper's baseline): COCO-LM
#: (Meng et al. 2021) "achieves the MNLI accuracy of ELECTRA with 50% of its pretraining GPU hours", so its
#: time to ELECTRA's final quality (`hours_ratio` 0.5 is the claim) is reported beside its time to MLM's.
PAPER_BASELINES = (("cocolm", "electra"),)


def paper_baseline_health(curves: dict, floor_dev: Optional[list[float]], margin: float) -> dict[str, dict]:
    """`baseline_health` of each `PAPER_BASELINES` baseline the study trained (with the objective that
    claims against it), by name."""
    return {against: baseline_health(curves[against], floor_dev, margin)
            for objective, against in PAPER_BASELINES if objective in curves and against in curves}


def target_rows(curves: dict, health: dict, paper_health: Optional[dict[str, dict]] = None) -> list[dict]:
    """Paired time to MLM's final quality, per objective and metric, and to the paper's own baseline for the
    claims made against another one (`PAPER_BASELINES`); refused when that row's baseline is unhealthy:
    MLM's check (`health`) for the MLM rows, the paper baseline's own (`paper_health[name]`, refused when
    absent) for the others."""
    pairs = [(objective, "mlm") for objective in curves]
    pairs += [(objective, against) for objective, against in PAPER_BASELINES if objective in curves and against in curves]
    rows = []
    for objective, against in pairs:
        if against == "mlm":
            passed, refusal = health["passed"], "refused: baseline failed its health check"
        else:
            own = (paper_health or {}).get(against)
            passed = bool(own and own["passed"])
            refusal = (f"refused: {against} (the baseline) failed its health check" if own
                       else f"refused: {against} (the baseline) has no health check")
        by_seed, baseline = curves[objective], curves.get(against, {})
        for metric, higher in METRICS.items():
            if higher is None:
                continue
            result = time_to_target(baseline, by_seed, metric, higher)
            if not result["seeds"] or result["target"] is None or result["target"]["mean"] is None:
                continue
            row = {"objective": objective, "against": against, "metric": metric, "target": format_ci(result["target"]),
                   "reached": f"{result['reached']}/{len(result['seeds'])}"}
            for field in ("steps", "hours", "step_ratio", "hours_ratio"):
                if not passed:
                    row[field] = refusal
                else:
                    row[field] = format_ci(result[field], 4 if field == "hours" else 3) if result[field] else "not reached"
            rows.append(row)
    return rows


def run_rows(study: dict) -> list[dict]:
    """Every training run, sweep included: its health and its final numbers."""
    rows, seen = [], set()
    all_runs = [(r, False) for by_lr in study["sweep"].values() for r in by_lr.values()]
    all_runs += [(r, True) for runs in study["selected"].values() for r in runs]
    chosen = {(o, s["lr"]) for o, s in study["selection"].items()}
    for run, _ in all_runs:
        key = run["key"]
        if key.name in seen:
            continue
        seen.add(key.name)
        row = {"run": key.name, "objective": key.objective, "lr": key.lr, "seed": key.seed,
               "selected_lr": (key.objective, key.lr) in chosen, "status": run["status"]}
        if run["status"] == "ok":
            final = run["final"]
            report, select = final["heldout"]["report"], final["heldout"]["select"]
            health = run["train"]["train_health"]
            row.update(device_hours=final["device_hours"], heldout_mlm_acc=report["mlm_acc"],
                       unigram_acc=report["unigram_acc"], heldout_mlm_loss=report["mlm_loss"],
                       token_cosine=report["token_cosine"], collapsed=report["collapsed"],
                       select_mlm_loss=select["mlm_loss"],
                       sst2_select=((final.get("downstream") or {}).get("pretrained", {}).get("select") or {}).get("mean"),
                       sst2_dev=((final.get("downstream") or {}).get("pretrained", {}).get("dev") or {}).get("mean"),
                       train_token_cosine=health["token_cosine"], train_collapsed_steps=health["collapsed_steps"],
                       train_signals_at_chance=signals_at_chance(health),
                       **{f"train_{k.replace('/', '_')}": v for k, v in health["positive_cosines"].items()})
        else:
            row["error"] = run["train"].get("error")
        rows.append(row)
    return rows


def signals_at_chance(train_health: dict) -> Optional[str]:
    """The learning signals not learned over the last 20% of a run's logged steps (`pipeline.monitor.signals`,
    recorded by `pipeline.study.units.run_record`): "none", the terms with value / reference, or None for a run
    recorded before they were."""
    signals = train_health.get("signals")
    if signals is None:
        return None
    missed = [s for s in signals if not s["learned"]]
    return "; ".join(f"{s['term']} {s['value']:.3f} vs {s['reference']:.3f}" for s in missed) or "none"


def curve_rows(curves: dict) -> list[dict]:
    rows = []
    for objective, by_seed in curves.items():
        for metric in METRICS:
            for r in mean_curve(list(by_seed.values()), metric):
                rows.append({"objective": objective, "metric": metric, **r})
    return rows


def plots(curves: dict, floor: Optional[dict], health: dict, out: Path,
          sts_floors: Sequence[tuple[float, str]] = ()) -> list[str]:
    """Quality against device-hours, steps and tokens, mean with its 95% band, per objective."""
    paths = []
    for metric in PLOTTED:
        rows = {obj: mean_curve(list(by_seed.values()), metric) for obj, by_seed in curves.items()}
        for x in AXES:
            if any(r[x] is None for rs in rows.values() for r in rs):
                continue  # tokens not recorded by some run (a study recorded before they were)
            series = {obj: [(r[x], r["mean"], r["lo"], r["hi"]) for r in rs] for obj, rs in rows.items()}
            if not any(series.values()):
                continue
            hlines = []
            if metric == "sst2_dev_accuracy" and floor is not None:
                hlines.append((float(sum(floor["dev"]["seeds"]) / len(floor["dev"]["seeds"])), "random init"))
            if metric == "token_cosine":
                hlines.append((COLLAPSE_COSINE, "collapse threshold"))
            if metric == "sts_test":
                hlines.extend(sts_floors)
            title = f"{metric} (mean, 95% band over seeds)" + ("" if health["passed"] else ": baseline UNHEALTHY")
            path = out / f"time_to_quality_{metric}_vs_{x}.png"
            line_chart(series, path, title, x.replace("_", "-"), metric, hlines=hlines)
            paths.append(str(path))
    return paths


def write_study_report(study: dict, args, data_notes: list[str], out: Path, extra: dict) -> dict:
    """All report files; returns the baseline health verdict and the paths."""
    curves = curves_of(study["selected"])
    floor = study["floor"]
    floor_dev = list(floor["dev"]["seeds"]) if floor else None
    health = baseline_health(curves.get("mlm", {}), floor_dev, args.plateau_margin)
    paper_health = paper_baseline_health(curves, floor_dev, args.plateau_margin)
    verdict = ("baseline health check PASSED: " if health["passed"] else
               "baseline health check FAILED, no ratio is reported: ")
    verdict += "; ".join(f"{c['check']}: {'ok' if c['passed'] else 'FAILED'} ({c['detail']})" for c in health["checks"])
    for against, own in paper_health.items():  # after every other note: notes[1] may become the STS verdict
        data_notes = [*data_notes, f"{against} (a paper's baseline) health check "
                      + ("PASSED: " if own["passed"] else f"FAILED, no ratio against {against} is reported: ")
                      + "; ".join(f"{c['check']}: {'ok' if c['passed'] else 'FAILED'} ({c['detail']})"
                                  for c in own["checks"])]
    selection = study["selection"]
    notes = [verdict,
             f"learning rate per objective chosen on {study['metric']} (a selection split, never reported) among "
             f"{[f'{lr:g}' for lr in args.lrs]}: " + ", ".join(f"{o} {s['lr']}" for o, s in selection.items()),
             "every figure: mean [95% t-interval] over pretraining seeds (SST-2: each seed's value is the mean over "
             f"fine-tuning seeds {args.finetune_seeds}); the floor's interval is over fine-tuning seeds",
             "time to target (time_to_quality_targets): paired per seed, target = the baseline's final value with the "
             "same seed (`against`: MLM for every objective; COCO-LM also against ELECTRA, the baseline its paper's "
             "claim is stated against: hours_ratio 0.5 is that claim); a mean is given only when every seed reached it",
             "device_hours = summed training step time x world size (no start-up, evaluation or checkpoint time)",
             "held-out MLM favours MLM-style heads (COCO-LM's main model never sees [MASK]; InfoWord and BERT-NCE "
             "train a sampled softmax, read here through the head conversion exports: scores + log q); SST-2 is the "
             "comparison that is fair to every objective",
             *data_notes]
    rows = summary_rows(study, curves, floor)
    targets = target_rows(curves, health, paper_health)
    runs = run_rows(study)
    curve_table = curve_rows(curves)
    sts_rows = comparison_rows(curves)
    if sts_rows:
        notes.insert(1, sts_verdict(sts_rows, health["passed"]))
    payload = {**extra, "baseline_health": health, "paper_baseline_health": paper_health, "selection": selection,
               "floor": floor, "targets": targets, "runs": runs, "selection_metric": study["metric"], "sts_comparison": sts_rows or None}
    paths = write_report("time_to_quality", rows, out, "Time to quality (selected learning rates)", notes=notes,
                         extra=payload)
    write_report("time_to_quality_targets", targets, out, "Time to the baseline's final quality (paired per seed)",
                 notes=notes[:1] + [n for n in notes if n.startswith("time to target")
                                    or "(a paper's baseline) health check" in n])
    if sts_rows:
        write_report("time_to_quality_sts", sts_rows, out, "Zero-shot STS-B against MLM (Spearman x 100)",
                     notes=[notes[1], "equal budget: both runs' final points; matched compute: each run's last point "
                            "within the smaller of the two runs' final device-hours (per seed); selected on dev: each run's "
                            "point with the highest STS-B dev, read on test; mean [95% t-interval] "
                            "over pretraining seeds; separates: the two intervals do not overlap; difference_paired: "
                            "per-seed difference, mean [95% t-interval]", *[n for n in notes if n.startswith("budget")]])
    write_report("time_to_quality_runs", runs, out, "Every run, sweep included: health and final numbers",
                 notes=[f"collapsed: held-out mean token cosine > {COLLAPSE_COSINE}; train_collapsed_steps: logged "
                        "training steps with health/collapsed = 1",
                        "train_signals_at_chance: the learning signals (pipeline.monitor.signals: each term against its "
                        "chance level, the unigram plateau or entropy, the collapse threshold) not learned over the "
                        "last 20% of the logged steps"])
    write_report("time_to_quality_curves", curve_table, out, "Evaluation curves (mean, 95% interval over seeds)",
                 notes=[n for n in notes if n.startswith("every figure")])
    pngs = plots(curves, floor, health, out, floor_lines(study["selected"]))
    return {"health": health, "verdict": verdict, "paths": {**{k: str(v) for k, v in paths.items()}, "png": pngs}}
