"""Data preparation benchmarks and synthetic shards."""
