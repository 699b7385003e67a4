"""Phase 2: the DeepSpeed training loop (`loop`, run as `python -m pipeline.train`) and its parts:
engine settings, optimizer and schedule, preemption, the non-finite guard, metrics; checkpointing
(`checkpoint/`) and training phases (`phases/`) are rooms of their own."""
