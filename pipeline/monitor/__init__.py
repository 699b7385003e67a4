"""In-training monitoring, read by the train loop, the pretraining model and the converter alike:
representation collapse measures (`health`) and each learning signal against its chance level
(`signals`). Post-training evaluation (fine-tuning) is `pipeline.eval`."""
