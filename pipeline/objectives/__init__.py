"""Pretraining objectives. Importing this package registers every objective in `OBJECTIVES`."""
from pipeline.objectives.base import OBJECTIVES, VIEWS, Objective, StepContext, register

__all__ = ["OBJECTIVES", "VIEWS", "Objective", "StepContext", "register"]
