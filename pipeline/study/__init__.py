"""The time-to-quality study (`cpt-study plan|submit|run|status|collect STUDY.yaml`): every objective trained
under one budget, each checkpoint evaluated, and the report of which reaches MLM's quality, how soon.

    spec.py            the study file (YAML) and its checks: `load_study`, `Study`, `StudyError`
    plan.py            `cpt-study plan`: the jobs and their estimated GPU-hours
    units.py           the units (pretraining run, evaluation point, selection, final test), each leaving files
    jobs.py, local.py  the two executors of the units: SLURM jobs (`submit`) and this process (`run`)
    results.py         the study read back from its files: the learning-rate selection and `collect`
    data.py            held-out halves and a task's selection split
    evaluate.py        one converted checkpoint: held-out masked-LM metrics, fine-tuning
    targets.py         time-to-target arithmetic over evaluation curves
    sts_comparison.py  zero-shot STS-B against MLM at equal budget and matched compute
    report.py          the report: tables, plots, intervals, the baseline's health check
    cli.py             the `cpt-study` command; `stop_signal.py`: SIGTERM as a clean stop of `run`

It sits on top of the library's layers (it drives `pipeline.train`, `export`, `eval` and reads what runs
write); intervals come from `pipeline.stats`, report files from `pipeline.report_files`.
"""
