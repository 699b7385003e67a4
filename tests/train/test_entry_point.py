"""`python -m pipeline.train`'s process-level teardown (`pipeline/train/__main__.py`)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.train.runs import REPO, _env

PROBE = textwrap.dedent("""
    import atexit, sys, threading, time
    import torch.distributed as dist

    import pipeline.train.__main__ as entry
    import pipeline.train.cli as cli
    from pipeline.distributed import init_distributed

    class Finalised:  # a module global: its __del__ runs only if the interpreter is finalised
        def __del__(self):
            print("finalised", flush=True)

    keep = Finalised()

    def late_writer():
        time.sleep(0.5)
        print("non-daemon thread finished", flush=True)

    def a_run_that_made_a_process_group():
        init_distributed(backend="gloo", timeout_s=60)
        assert dist.is_initialized()
        threading.Thread(target=late_writer).start()  # e.g. a checkpoint finisher still writing
        return 7

    atexit.register(lambda: print("atexit ran; process group left", dist.is_initialized()))
    print("buffered line, never flushed by hand", end="")
    cli.main = a_run_that_made_a_process_group
    entry.run()
    print("not reached")
""")


def test_the_entry_point_destroys_the_process_group_and_ends_without_finalising():
    """A gloo group alive at interpreter teardown can abort a finished rank (SIGABRT, exit 134): the
    entry point destroys the group, waits for non-daemon threads, runs the atexit handlers, flushes the
    streams and ends without interpreter finalisation, keeping the run's exit code."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 7, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "non-daemon thread finished" in lines, out.stdout
    assert lines[-1] == "atexit ran; process group left False", out.stdout
    assert out.stdout.startswith("buffered line, never flushed by hand"), out.stdout
    assert "finalised" not in out.stdout and "not reached" not in out.stdout, out.stdout


def test_an_entry_point_without_a_process_group_exits_normally():
    """`--help-config` makes no process group: a plain `sys.exit`, the interpreter finalised as usual."""
    probe = textwrap.dedent("""
        import sys
        import pipeline.train.__main__ as entry
        sys.argv = ["pipeline.train", "--help-config"]
        try:
            entry.run()
        except SystemExit as done:
            print("exit", done.code)
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "exit 0", out.stdout + out.stderr[-3000:]
