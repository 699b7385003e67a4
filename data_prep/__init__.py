"""Offline data preparation: tokenizer training, Arrow shard building and verification."""
