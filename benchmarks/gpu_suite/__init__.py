"""The GPU suite: one front door that turns a GPU - a 15-minute lease or your own - into the project's
performance evidence.

`python -m benchmarks.gpu_suite --plan` prints the commands to type on a lease and checks the plan
against it, `--prepare` builds what travels, `--stage NAME` runs one command's rows, `--local`
every command on a GPU of your own, `--dry-run` rehearses them on the CPU, `--collect DIR` files the
results and regenerates the README's performance table. Modules: `plan` (the rows in value order,
the commands, the lease arithmetic), `runner` (the one runner; files through `pipeline/report_files.py`, the
one writer), `train_rows` and `kernel_rows` (what a row measures), `targets`, `prepare`, `collect`.
"""
