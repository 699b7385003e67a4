"""`python -m pipeline.train`'s process-level teardown (`pipeline/train/__main__.py`)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.train.runs import REPO, _env

PROBE = textwrap.dedent("""
    import torch.distributed as dist

    import pipeline.train.__main__ as entry
    import pipeline.train.loop as loop
    from pipeline.distributed import init_distributed

    def a_run_that_made_a_process_group():
        init_distributed(backend="gloo", timeout_s=60)
        assert dist.is_initialized()
        return 7

    loop.main = a_run_that_made_a_process_group
    try:
        entry.run()
    except SystemExit as done:
        print("exit", done.code, "process group left", dist.is_initialized())
""")


def test_the_entry_point_destroys_the_process_group_and_keeps_the_exit_code():
    """A gloo group alive at interpreter teardown can abort a finished rank (SIGABRT, exit 134):
    the entry point destroys it after the run and still exits with the run's code."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exit 7 process group left False" in out.stdout, out.stdout + out.stderr[-3000:]
