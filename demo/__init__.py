"""The front-door demo, kept apart from the library: corpus -> tokenizer -> shards -> pretraining ->
Hugging Face -> fill-mask, on a small default (`python -m demo`)."""
