"""Training phases (`phases:`) and the batch-size warm-up: `config` (what a phase entry may say,
checked before compute; each phase's `data.*` and LR segment), `schedule` (`Schedule`: the phases
planned against their shards, and what to change before a step), `switch` (a phase change applied
to the live model and DeepSpeed engine) and `resume` (what a resume may change in the phases and in
the mixture being read). A run without `phases` walks one implicit phase, so the loop has one path."""
