"""The GPU suite: one front door that turns a lent GPU into the project's performance evidence.

`python -m benchmarks.gpu_suite --plan` lists the stages (one device command each), `--prepare`
builds what travels, `--stage NAME` runs one on the GPU machine, `--dry-run` rehearses them all on
the CPU, `--collect DIR` files the results and regenerates the README's performance table.
Modules: `plan` (stages, budgets, limits), `stage_io` (context and the one writer), `targets`,
one module per stage (`env_stage`, `kernels_stage`, `throughput_stage`, `sanity_stage`),
`prepare`, `collect`.
"""
