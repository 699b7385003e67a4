"""Fused loss kernel benchmarks."""
