"""Recipe health benchmarks (collapse checks)."""
