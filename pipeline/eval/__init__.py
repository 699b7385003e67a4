"""Downstream evaluation of converted checkpoints: GLUE-format tasks (`glue`) and fine-tuning (`finetune`).
In-training health and learning signals are `pipeline.monitor`."""
