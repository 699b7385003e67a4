"""The network: a BERT encoder with Hugging Face parameter names (`encoder`), its heads (`heads`),
and `PretrainModel` = encoder + MLM head + weighted objectives (`pretrainer`), built by `build`."""
