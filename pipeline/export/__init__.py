"""Phase 3: checkpoints -> Hugging Face directories (`convert`), the two-way state-dict adapter
(`hf_adapter`) and the model card (`model_card`)."""
