"""The demo's start-up note (`demo.run.startup_note`: one process, nothing compiled) and its live echo of the
training output, which shows build lines should any appear and hides DeepSpeed's CPU chatter (`demo.run.shown_live`)."""
from __future__ import annotations


from demo.run import shown_live, startup_note


def test_startup_note_says_nothing_is_compiled() -> None:
    """One training process builds no DeepSpeed op (tests/test_distributed_comm_op.py proves it on a fresh
    extensions directory), so the note no longer promises a compilation."""
    note = startup_note()
    assert "no C++ op to compile" in note and "compiles" not in note


def test_build_lines_are_shown_and_cpu_chatter_is_not() -> None:
    """The chatter and the "built successfully" line as DeepSpeed printed them on this CPU machine (the latter
    captured from a real build of its shm op in a fresh extensions directory); torch's build messages as they
    read when a logger tags them."""
    chatter = ["[2026-11-25 12:05:43,015] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator "
               "to CPU. If you have GPU or other accelerator, we were unable to detect it.",
               "[2026-11-25 12:06:01,100] [INFO] [config.py:1003:print] zero_optimization ...... stage 1"]
    build = ["DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
             "[2026-11-25 12:06:00,000] [INFO] [builder.py:600:jit_load] Building extension module deepspeed_shm_comm...",
             "[2026-11-25 12:06:30,000] [WARNING] [builder.py:620:jit_load] Loading extension module deepspeed_shm_comm..."]
    ours = ["step 1/20 loss 9.1", "error: optim.warmup_steps=2 must be < train.total_steps=2"]
    assert not any(shown_live(line) for line in chatter)
    assert all(shown_live(line) for line in build + ours)
