"""`python -m pipeline.launch_requeue [torchrun arguments]`: torchrun that passes the requeue code on.

torchrun (torch's elastic agent) exits 1 whenever a worker exits non-zero, so a preempted run
whose ranks all exited `REQUEUE_EXIT_CODE` (75: checkpointed, requeue me) looks to the scheduler
like any failure. This wrapper runs the same launcher in-process (`torch.distributed.run`, the
same arguments) and decides the exit code from the workers' own codes:

| workers                                          | exit code |
| ------------------------------------------------ | --------- |
| all exited 0                                     | 0         |
| every failed worker exited 75                    | 75 (requeue) |
| the launcher itself got SIGTERM/SIGINT/SIGHUP (torchrun forwards it to the workers, which checkpoint and exit 75) | 75 |
| otherwise (one code shared by every failed worker, e.g. 2, 3, 4, 5) | that code |
| otherwise (different codes)                      | 1         |

`slurm/` jobs run the ranks with `srun` (every rank's code reaches SLURM directly) and need no
wrapper; this is for jobs that launch with torchrun (docs/guarantees.md, class 5).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from pipeline.train.preemption import REQUEUE_EXIT_CODE


def exit_code_of(failures: dict) -> int:
    """The job's exit code from torchrun's `{rank: ProcessFailure}` of the workers that failed."""
    codes = {int(failure.exitcode) for failure in failures.values()}
    if codes == {REQUEUE_EXIT_CODE}:
        return REQUEUE_EXIT_CODE
    return codes.pop() if len(codes) == 1 and next(iter(codes)) > 0 else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as err:
        code = exit_code_of(err.failures)
        print(f"launch_requeue: workers failed with codes { {r: f.exitcode for r, f in err.failures.items()} }; "
              f"exiting {code}" + (" (exit code 75 of every rank: requeue)" if code == REQUEUE_EXIT_CODE else ""),
              file=sys.stderr)
        return code
    except SignalException as err:
        print(f"launch_requeue: the launcher got {err.sigval.name}; the workers were told to checkpoint; exiting "
              f"{REQUEUE_EXIT_CODE} (requeue)", file=sys.stderr)
        return REQUEUE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
