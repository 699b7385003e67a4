"""Checkpointing: everything a run writes into `<train.output_dir>/checkpoints/` and reads back to resume.

`checkpointer` (`Checkpointer`: when to save, the health gate, pruning, the best tag, resume) decides;
`tags` does it (a tag's files, complete-or-absent, `latest`, verification, pruning, `TrainState`,
`plan_resume`), writing through `writes` (a failed write is one clear error on every rank) and loading
through `load` (verified, the universal conversion, the restricted unpickler); `best` and
`best_resume` keep the best tag (`best.json`) across saves and resumes; `readme` writes the
directory's conversion note. Resume planning beside `plan_resume`: `resume_run` (`cpt-train --resume
DIR`, the saved config as the base) and `schedule_branch` (a decay branched off a stable-phase
checkpoint). `run_lock` keeps one writer per run directory, checked before every save. What a tag
says about its run, `pipeline_meta.json`, is `pipeline.train.run_meta`; what a resume may change in
the phases, `pipeline.train.phases.resume`."""
