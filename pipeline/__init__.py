"""Contrastive pretraining of BERT-style encoders (TACO, CAPT, COCO-LM, InfoWord, MLM) on DeepSpeed."""

__version__ = "0.1.0"
