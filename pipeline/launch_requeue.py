"""`python -m pipeline.launch_requeue [torchrun arguments]`: torchrun that passes the requeue code on;
`python -m pipeline.launch_requeue --deepspeed [deepspeed arguments]`: the same for DeepSpeed's launcher.

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

DeepSpeed's launcher (`deepspeed ...`, DeepSpeed 0.19's `launcher/runner.py` and `launch.py`) exits
with the first failing rank's code, so ranks that were signalled themselves and exit 75 make it exit
75 (tested). A SIGTERM to the *launcher*, though, ends the job with no checkpoint (measured with
DeepSpeed 0.19.8 on 2 CPU ranks: the runner dies of it, exit 143, and no checkpoint is written; its
per-machine `launch.py`, when signalled, terminates the ranks and exits 1). With `--deepspeed` this wrapper runs
`deepspeed` as a child in a session of its own and, when it gets SIGTERM/SIGINT/SIGUSR1/SIGHUP,
sends SIGUSR1 to the ranks of this machine (the children of `deepspeed.launcher.launch`) instead,
retrying for ranks that start later; they checkpoint and exit 75, which the launcher passes on. A
second signal is passed to the launcher itself (its own kill path). Ranks on other machines (pdsh
over ssh) are out of its reach: there, signal every node's ranks (a scheduler's step signal does).

`slurm/` jobs run the ranks with `srun` (every rank's code reaches SLURM directly) and need no
wrapper; this is for jobs that launch with torchrun or `deepspeed` (docs/guarantees.md, class 5).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from pipeline.train.preemption import REQUEUE_EXIT_CODE


def exit_code_of(failures: dict) -> int:
    """The job's exit code from torchrun's `{rank: ProcessFailure}` of the workers that failed."""
    codes = {int(failure.exitcode) for failure in failures.values()}
    if codes == {REQUEUE_EXIT_CODE}:
        return REQUEUE_EXIT_CODE
    return codes.pop() if len(codes) == 1 and next(iter(codes)) > 0 else 1


#: Signals the `--deepspeed` wrapper turns into a checkpoint-and-requeue of the ranks.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
#: The module DeepSpeed's runner starts once per machine; its children are the ranks.
DEEPSPEED_NODE_LAUNCHER = "deepspeed.launcher.launch"


def deepspeed_ranks(launcher_pid: int) -> list:
    """The rank processes (psutil) under a `deepspeed` runner: children of its per-machine launcher."""
    import psutil

    try:
        tree = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for proc in tree:
        try:
            if DEEPSPEED_NODE_LAUNCHER in " ".join(proc.parent().cmdline()):
                ranks.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):  # gone meanwhile / no parent
            continue
    return ranks


def run_deepspeed(args: Sequence[str], poll_s: float = 0.2) -> int:
    """`deepspeed args...` with a signal to this process turned into SIGUSR1 to the ranks (module doc)."""
    launcher = subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", *args], start_new_session=True)
    received: list[int] = []

    def note(signum: int, _frame) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in FORWARDED_SIGNALS}
    signalled: set[int] = set()
    passed_on = False
    try:
        while launcher.poll() is None:
            if received and not passed_on and len(received) > 1:  # a second signal: DeepSpeed's own kill path
                launcher.send_signal(signal.SIGINT)
                passed_on = True
            elif received:
                for rank in deepspeed_ranks(launcher.pid):
                    if rank.pid not in signalled:
                        rank.send_signal(signal.SIGUSR1)
                        signalled.add(rank.pid)
                        print(f"launch_requeue: got {signal.Signals(received[0]).name}; sent SIGUSR1 to rank pid "
                              f"{rank.pid} (checkpoint, then exit {REQUEUE_EXIT_CODE})", file=sys.stderr, flush=True)
            time.sleep(poll_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = launcher.returncode
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    if code == REQUEUE_EXIT_CODE:
        print(f"launch_requeue: deepspeed exited {code} (the ranks checkpointed: requeue)", file=sys.stderr)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--deepspeed"]:
        return run_deepspeed(args[1:])
    return run_torchrun(args)


def run_torchrun(args: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(args)))
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
