"""The issue's targets (one run, same GPU), each judged met / missed from numbers measured in one stage.

    MLM BERT-large MFU >= 50% at L=512 and >= 45% at L=128; MLM >= 1.3x hf-bert tokens/s;
    each objective's MFU >= 0.9x MLM's; fused linear cross-entropy peak memory <= 1.1x Cut
    Cross-Entropy's and >= 4x below eager fp32, time <= Liger's; token InfoNCE >= 10x less memory
    and >= 3x faster than eager; queue InfoNCE <= 1% of the MLM step.

A target is judged only on a GPU run (`applicable`); on the CPU rehearsal, or when a number is
missing (a peer not installed, a row out of memory), it is listed with `met: None` ("not judged").
"""
from __future__ import annotations

from typing import Any, Optional

MFU_MLM = {128: 0.45, 512: 0.50}
MLM_VS_HF = 1.3
OBJECTIVE_MFU_VS_MLM = 0.9
LCE_MEM_VS_CCE = 1.1
LCE_MEM_BELOW_EAGER_FP32 = 4.0
LCE_TIME_VS_LIGER = 1.0
TOKEN_INFONCE_MEM = 10.0
TOKEN_INFONCE_SPEED = 3.0
QUEUE_SHARE_OF_MLM_STEP = 0.01


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
