"""The issue's targets (one run, same GPU), judged met / missed from the rows a command has finished so far.

    MLM BERT-large MFU >= 50% at L=512 and >= 45% at L=128; MLM >= 1.3x hf-bert tokens/s;
    each objective's MFU >= 0.9x MLM's (same length, same command); fused linear cross-entropy
    peak memory <= 1.1x Cut Cross-Entropy's and >= 4x below eager fp32, time <= Liger's; token
    InfoNCE >= 10x less memory and >= 3x faster than eager; queue InfoNCE <= 1% of a CAPT step;
    every fused loss correct (env row) and `pytest -m gpu` passing.
    ModernBERT (a paired command, `judge_pairs`): large-24 on packed shards >= 40% MFU and >= 1.3x the
    useful tokens/s of BERT-large on the same shards (issue 56).

A performance target is judged only on a GPU run (`applicable`); on the CPU rehearsal, or while a
number is missing (a row not run yet, a peer not installed, a row out of memory), it is listed
with `met: None` ("not judged"). Correctness is judged on the rehearsal too.
"""
from __future__ import annotations

from typing import Any, Optional

from benchmarks.kernels.bench_kernels import target_minimum

MFU_MLM = {128: 0.45, 512: 0.50}
MLM_VS_HF = 1.3
OBJECTIVE_MFU_VS_MLM = 0.9
LCE_MEM_VS_CCE = 1.1
LCE_TIME_VS_LIGER = 1.0  # against the peers: the suite's own (the kernel benchmark has no peers by default)
# The kernel thresholds: one table, the kernel benchmark's (benchmarks.kernels.bench_kernels.TARGETS).
LCE_MEM_BELOW_EAGER_FP32 = target_minimum("linear_cross_entropy", "mem")
TOKEN_INFONCE_MEM = target_minimum("token_contrastive_loss", "mem")
TOKEN_INFONCE_SPEED = target_minimum("token_contrastive_loss", "speed")
QUEUE_SHARE_OF_CAPT_STEP = 0.01
MODERNBERT_PACKED_MFU = 0.40
MODERNBERT_PACKED_VS_BERT = 1.3


def target(name: str, measured: Optional[float], op: str, threshold: float, applicable: bool,
           note: str = "") -> dict[str, Any]:
    """One judged target: `measured op threshold` (op '>=' or '<='); `met` None when not judged."""
    if op not in (">=", "<="):
        raise ValueError(f"target {name}: op must be '>=' or '<=', got {op!r}")
    met = None
    if applicable and measured is not None:
        met = measured >= threshold if op == ">=" else measured <= threshold
    return {"name": name, "measured": measured, "target": f"{op} {threshold:g}", "met": met, "note": note}


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or den is None or den <= 0 else num / den


def judge(rows: list[dict[str, Any]], gpu: bool) -> list[dict[str, Any]]:
    """Every target the finished rows allow (performance only with `gpu`), in row order."""
    out: list[dict[str, Any]] = []
    train = {(r["kind"], r.get("arch", "bert"), r.get("objective"), r.get("seq_len")): r
             for r in rows if r["kind"] in ("train", "hf") and "error" not in r and r.get("shards", "full") == "full"}
    for r in rows:
        kind, length = r["kind"], r.get("length")
        if "error" in r:
            continue
        if kind == "env":
            out += [target(f"correct {c['case']}", float(c["ok"]), ">=", 1.0, True,
                           c.get("error", f"loss {c.get('loss_rel_err', 0):.1e}, grad {c.get('grad_rel_err_max', 0):.1e}"))
                    for c in r["correctness"]]
        elif kind == "pytest":
            out.append(target("pytest -m gpu passes", None if r["exit"] is None else float(r["exit"] == 0), ">=", 1.0,
                              True, r["summary"]))
        elif kind == "queue":
            out.append(target(f"L={length} queue InfoNCE share of a CAPT step", r["share"], "<=",
                              QUEUE_SHARE_OF_CAPT_STEP, gpu, "CAPT loss per micro-batch / CAPT step time per micro-batch"))
        elif kind == "hf":
            mlm = train.get(("train", "bert", "mlm", r["seq_len"]), {})
            out.append(target(f"L={length} MLM tokens/s vs hf-bert", ratio(mlm.get("tokens_per_s"), r.get("tokens_per_s")),
                              ">=", MLM_VS_HF, gpu))
        elif kind == "train" and r["arch"] == "bert" and r.get("shards", "full") == "full":
            if r["objective"] == "mlm":
                out.append(target(f"L={length} MLM MFU", r.get("mfu"), ">=", MFU_MLM[length], gpu))
            else:
                mlm = train.get(("train", "bert", "mlm", r["seq_len"]), {})
                out.append(target(f"L={length} {r['objective']} MFU / MLM's", ratio(r.get("mfu"), mlm.get("mfu")), ">=",
                                  OBJECTIVE_MFU_VS_MLM, gpu))
        elif kind == "kernel":
            out += kernel_targets(r, gpu)
    return out


def judge_pairs(rows: list[dict[str, Any]], gpu: bool) -> list[dict[str, Any]]:
    """A ModernBERT-vs-BERT command's targets: every ModernBERT row on packed shards (MLM) at
    >= `MODERNBERT_PACKED_MFU` and >= `MODERNBERT_PACKED_VS_BERT` x its BERT partner's tokens/s (real
    tokens: padding is not counted)."""
    out = []
    for r in rows:
        if r["kind"] != "train" or r.get("arch") != "modernbert" or r.get("shards") != "packed" or "error" in r:
            continue
        length, objective = r.get("length"), r.get("objective")
        out += [target(f"L={length} ModernBERT {objective} MFU on packed shards", r.get("mfu"), ">=",
                       MODERNBERT_PACKED_MFU, gpu),
                target(f"L={length} ModernBERT {objective} useful tokens/s vs BERT-large on packed shards",
                       r.get("tokens_vs_bert"), ">=", MODERNBERT_PACKED_VS_BERT, gpu, "both unpadded (varlen)")]
    return out


def kernel_targets(r: dict[str, Any], gpu: bool) -> list[dict[str, Any]]:
    get = {(x["case"], x["impl"]): x for x in r["results"]}
    size, lce, tok = r["size"], "linear_cross_entropy", "token_contrastive_loss"

    def value(case: str, impl: str, key: str) -> Optional[float]:
        return get.get((case, impl), {}).get(key)

    out = []
    if (lce, "triton") in get:
        out += [target(f"{size} fused linear CE peak memory / CCE's", ratio(value(lce, "triton", "peak_mib"),
                       value(lce, "cce", "peak_mib")), "<=", LCE_MEM_VS_CCE, gpu),
                target(f"{size} fused linear CE memory below eager fp32", value(lce, "triton", "mem_below_eager_fp32"),
                       ">=", LCE_MEM_BELOW_EAGER_FP32, gpu),
                target(f"{size} fused linear CE time / Liger's", ratio(value(lce, "triton", "ms"),
                       value(lce, "liger", "ms")), "<=", LCE_TIME_VS_LIGER, gpu)]
    if (tok, "triton") in get:
        out += [target(f"{size} token InfoNCE memory below eager", value(tok, "triton", "mem_below_eager_bf16"), ">=",
                       TOKEN_INFONCE_MEM, gpu, "eager on the same bf16 inputs"),
                target(f"{size} token InfoNCE speed-up over eager", value(tok, "triton", "speedup_vs_eager_bf16"), ">=",
                       TOKEN_INFONCE_SPEED, gpu, "eager on the same bf16 inputs")]
    return out
