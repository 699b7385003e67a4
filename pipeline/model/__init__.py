"""The network: a BERT encoder with Hugging Face parameter names (`encoder`), the ModernBERT family
(`modernbert`) and the dispatch between them (`arch`), its heads (`heads`), `ModelConfig` (`config`),
the Hugging Face name maps (`hf_names`) and warm starts from a Hugging Face directory (`warm_start`).
Encoder + objectives is `pipeline.pretrain`, one layer up."""
