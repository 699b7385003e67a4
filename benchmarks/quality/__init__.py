"""Time-to-quality benchmarks (pretraining to a held-out/downstream target)."""
