"""Downstream evaluation of converted checkpoints: GLUE-format tasks (`glue`) and fine-tuning (`finetune`)."""
