"""`python -m pipeline.train` (and the `cpt-train` console script): the pretraining entry point.

The preemption handler goes in before anything else, with the standard library only: importing
torch and DeepSpeed takes seconds, and a SIGTERM/SIGUSR1 in that time must end in the requeue
exit code, not kill the rank. It stays until `main` has returned its exit code; then both signals
are ignored so that nothing during interpreter teardown changes that code
(`pipeline.train.preemption`). Arguments and exit codes: `pipeline.train.cli`; the loop: `pipeline.train.loop`.

A run that made a process group ends without finalising the interpreter (`exit_without_finalizing`):
gloo worker threads of groups that outlive `destroy_process_group` (DeepSpeed keeps references to
ZeRO-3's groups) abort the process during finalisation now and then (SIGABRT, "terminate called
without an active exception"; measured: 1 run in 12-24 of a 2-rank ZeRO-3 run), turning a completed
run's exit 0 into 134.

Rank 0 records how the run ended in `<output_dir>/run_state.json` (`pipeline.train.exit_record`,
read by `cpt-status`).
"""
import sys

from pipeline.train import exit_record
from pipeline.train.preemption import ignore_signals, install_process_handler


def exit_without_finalizing(code: int) -> None:
    """End the process with `code` as a normal exit would, minus the interpreter's finalisation:
    wait for the non-daemon threads, run the `atexit` handlers (logging's flush among them), flush
    the standard streams, then `os._exit`. Nothing of the run is left to finalise by then: its
    checkpoint finisher has been settled and its files closed by `main`."""
    import atexit
    import os
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter itself calls at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def run() -> None:
    install_process_handler()
    made_group = False
    tap = sys.stderr = exit_record.ErrorLineTap(sys.stderr)  # the error line of a failed run, for its exit record
    try:
        from pipeline.train.cli import main

        try:
            code = main()
        except BaseException as err:  # an uncaught error: exit 1 (130 for Ctrl-C), recorded, then raised
            exit_record.finish(130 if isinstance(err, KeyboardInterrupt) else 1,
                               f"{type(err).__name__}: {err}".splitlines()[0])
            raise
        exit_record.finish(code, tap.last_error)
    finally:
        sys.stderr = tap.stream
        try:
            if "pipeline.distributed" in sys.modules:  # a run started (`--help`, config errors: no torch import)
                made_group = sys.modules["pipeline.distributed"].shutdown_distributed()
        finally:
            ignore_signals()
    if made_group:
        exit_without_finalizing(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
