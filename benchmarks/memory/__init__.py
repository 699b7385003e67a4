"""Memory benchmarks (activation checkpointing: peak activation memory with vs without)."""
