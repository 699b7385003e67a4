"""The demo announces DeepSpeed's C++ op build before the training process goes quiet to compile it
(`demo.run.startup_note`), in the directory the training process really uses, and echoes the build's own
lines while hiding DeepSpeed's CPU chatter (`demo.run.shown_live`)."""
from __future__ import annotations

from pathlib import Path

from demo.run import shown_live, startup_note


def test_startup_note_says_whether_the_ops_will_be_compiled(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    first = startup_note()
    assert "DeepSpeed compiles its C++ CPU ops" in first and str(cache) in first and "first run" in first
    (cache / "deepspeed_shm_comm").mkdir(parents=True)
    (cache / "deepspeed_shm_comm" / "build.ninja").write_text("")  # a build that stopped before linking
    assert "compiles" in startup_note()
    (cache / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    again = startup_note()
    assert "already built" in again and str(cache) in again and "compiles" not in again


def test_startup_note_names_the_directory_training_builds_in(tmp_path: Path, monkeypatch) -> None:
    """Unset, the note looks where `pipeline.train` will point TORCH_EXTENSIONS_DIR (its private,
    per-environment directory), not torch's shared default."""
    from pipeline.capabilities import private_extensions_dir, use_private_extensions_dir

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    note = startup_note()
    assert str(private_extensions_dir()) in note and "compiles" in note
    assert use_private_extensions_dir() == str(private_extensions_dir())  # what the training process sets


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
