"""Pretraining objectives. Importing this package registers every objective in `OBJECTIVES`.

One module per objective (`mlm`, `mlm_nce`, `taco`, `capt`, `cocolm`, `infoword`); the loss math
lives in `functional` (pure functions, the torch reference of the Triton kernels) and the index
sampling in `sampling`.
"""
from pipeline.objectives.base import OBJECTIVES, VIEWS, Objective, StepContext, register
from pipeline.objectives import capt, cocolm, infoword, mlm, mlm_nce, taco  # noqa: F401  (they register)

__all__ = ["OBJECTIVES", "VIEWS", "Objective", "StepContext", "register"]
