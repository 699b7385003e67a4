"""`python -m pipeline.train` (and the `cpt-train` console script): the pretraining entry point.

The preemption handler goes in before anything else, with the standard library only: importing
torch and DeepSpeed takes seconds, and a SIGTERM/SIGUSR1 in that time must end in the requeue
exit code, not kill the rank. It stays until `main` has returned its exit code; then both signals
are ignored so that nothing during interpreter teardown changes that code
(`pipeline.train.preemption`). The loop itself is `pipeline.train.loop`.
"""
import sys

from pipeline.train.preemption import ignore_signals, install_process_handler


def run() -> None:
    install_process_handler()
    try:
        from pipeline.train.loop import main

        code = main()
    finally:
        try:
            if "pipeline.distributed" in sys.modules:  # a run started (`--help`, config errors: no torch import)
                sys.modules["pipeline.distributed"].shutdown_distributed()  # a live gloo group can abort the exit
        finally:
            ignore_signals()
    sys.exit(code)


if __name__ == "__main__":
    run()
