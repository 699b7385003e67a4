"""The pretraining model: `PretrainModel` = encoder + MLM head + weighted objectives (`pretrainer`),
what DeepSpeed wraps, and the one constructor (`build`). It sits above both `pipeline.model` and
`pipeline.objectives`, the two things it composes."""
