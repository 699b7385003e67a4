"""`python -m pipeline.train --config PRESET_OR_YAML [section.key=value ...]` (`cpt-train`): the pretraining entry point.

Argument parsing, the process set-up of one run and the mapping of its errors to exit codes; the
run itself is `pipeline.train.loop` (`start` builds it, `Run.loop` trains it, `Run.train_step` is
one step) and its checkpoints are `pipeline.train.checkpoint.checkpointer.Checkpointer`'s. The same code
runs with no launcher (one process), under `torchrun`, the `deepspeed` launcher, `srun` or
`mpirun` (`pipeline.distributed.discover` reads the environment; `--mpi` asks mpi4py when the MPI
implementation exports nothing we know). `--resume DIR [overrides]` continues a run from the
configuration saved in its checkpoint (`pipeline.train.checkpoint.resume_run`: extending `train.total_steps`,
with the learning-rate schedule re-stretched to the new total).

Exit codes (docs/guarantees.md): 0 done; 2 bad config, data or unusable checkpoint (message on
stderr, before compute); 3 stopped by the non-finite / divergence guard (no checkpoint of
non-finite or exploded weights is written; the message names the last good one); 4 the run's
output cannot be written (disk full, quota, I/O error at any save, the first included: the
previous checkpoint stays `latest`; or, before compute, `train.output_dir` is a file, read-only or
not creatable); 5 another rank died or hung (the message names it; a dead rank is noticed at the next
collective, a hung one after `train.dist_timeout_s`);
75 (`REQUEUE_EXIT_CODE`) SIGTERM/SIGUSR1: checkpointed for requeue (or, during start-up, nothing
new to save). Signals: `pipeline.train.preemption`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import yaml

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import RunConfig, check_run, describe_recipe, describe_run_config, load_config
from pipeline.train import exit_record
from pipeline.train.checkpoint.tags import CheckpointError, CheckpointWriteError
from pipeline.train.checkpoint.writes import check_output_dir
from pipeline.train.checkpoint.checkpointer import Checkpointer
from pipeline.train.guard import NonFiniteLossError
from pipeline.train.loop import build_run_model, start, torch_process_state
from pipeline.train.preemption import PreemptionHandler, preemption_scope
from pipeline.train.checkpoint.run_lock import hold_run_dir, released_at_exit

log = logging.getLogger("pipeline.train")
EXIT_CONFIG_ERROR = 2
EXIT_NONFINITE = 3
EXIT_SAVE_FAILED = 4
EXIT_RANK_LOST = 5


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="preset name in pipeline/config/presets/ (e.g. taco-small) or a YAML file")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue a run from its saved configuration (DIR: its output directory, checkpoints/ "
                             "or a tag); overrides change it, e.g. train.total_steps=N extends it "
                             "(pipeline.train.checkpoint.resume_run)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.total_steps=1000 data.shards_dir=DIR")
    parser.add_argument("--check", action="store_true", help="validate config, data and checkpoint, then exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--help-config", action="store_true", help="list every config field with its documentation")
    parser.add_argument("--mpi", action="store_true", help="take rank / world size from mpi4py")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="with --check: validate for N ranks instead of this launch's (slurm/submit.sh passes the job's)")
    parser.add_argument("--gpus", action="store_true",
                        help="with --check: validate as on a GPU node (bf16/fp16, triton, offload) from a machine without one")
    # The `deepspeed` launcher passes --local_rank=N (also exported as LOCAL_RANK); older torch
    # launchers pass --local-rank. The rank itself comes from the environment (pipeline.distributed).
    parser.add_argument("--local_rank", "--local-rank", type=int, metavar="N",
                        help="set by the deepspeed launcher; the same as LOCAL_RANK=N")
    args = parser.parse_args(argv)
    if args.resume and args.config:
        parser.error("--resume DIR takes the run's saved config: pass changes as overrides, not --config")
    if not args.config and not args.resume and not args.help_config:
        parser.error("--config (or --resume DIR) is required")
    if args.local_rank is not None:
        env = os.environ.get("LOCAL_RANK")
        if env is not None and env != str(args.local_rank):
            parser.error(f"--local_rank={args.local_rank} but LOCAL_RANK={env}: the launcher disagrees with itself")
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    if (args.world_size is not None or args.gpus) and not args.check:
        parser.error("--world-size and --gpus only go with --check")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.help_config:
        print(describe_run_config())
        return 0
    cfg: Optional[RunConfig] = None
    try:
        if args.resume:
            from pipeline.train.checkpoint.resume_run import load_resumed_config

            cfg, recipe = load_resumed_config(args.resume, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides)
            recipe = describe_recipe(args.config, cfg)
        if args.print_config:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            return 0
        if args.mpi:
            export_mpi4py_ranks()
        return train(cfg, check_only=args.check, recipe=recipe,
                     check_world_size=args.world_size, check_gpus=args.gpus)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NONFINITE
    except CheckpointWriteError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_SAVE_FAILED
    except RuntimeError as err:  # a dead or hung rank: one line naming it, not gloo's traceback
        from pipeline.distributed import lost_ranks_message

        message = lost_ranks_message(err, cfg.train.dist_timeout_s) if cfg is not None else ""
        if not message:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_RANK_LOST


def export_mpi4py_ranks() -> None:
    """`--mpi`: rank / world size / local rank from mpi4py, exported as torch's env variables, with
    rank 0's host and a free port as the rendezvous (`pipeline.distributed`'s MPI rendezvous)."""
    from mpi4py import MPI

    from pipeline.distributed import _mpi_rendezvous

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()), LOCAL_RANK=str(local))
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        addr, port = _mpi_rendezvous()  # collective: every rank calls it
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", port)


def train(cfg: RunConfig, check_only: bool = False, recipe: Optional[dict] = None,
          check_world_size: Optional[int] = None, check_gpus: bool = False) -> int:
    """Run (or, with `check_only`, just validate) the training described by `cfg`; returns the exit code.
    `recipe` (`describe_recipe`: preset and overrides) is recorded in the checkpoints for the model card;
    `check_world_size` / `check_gpus`: validate for that many ranks / as on a GPU node (`--check` only)."""
    # a signal from here on is a flag (pipeline.train.preemption); the run directory's lock ends with the run
    with preemption_scope() as preemption, released_at_exit():
        return _train(cfg, check_only, preemption, recipe, check_world_size, check_gpus)


def _train(cfg: RunConfig, check_only: bool, preemption: PreemptionHandler, recipe: Optional[dict] = None,
           check_world_size: Optional[int] = None, check_gpus: bool = False) -> int:
    from pipeline.capabilities import use_private_extensions_dir
    from pipeline.distributed import discover

    # ---- 1. everything that can be checked before compute ------------------------------------
    use_private_extensions_dir()
    world = discover()
    world_size = check_world_size or world.world_size
    cfg.train.output_dir = cfg.train.output_dir or str(Path("runs") / cfg.name)
    checkpointer = Checkpointer(cfg.train, world.rank == 0)
    resume_dir = checkpointer.find_resume()
    # A resumed run takes its weights from the checkpoint: model.init_from's weights are neither
    # checked nor read then (its config.json still gives the shape).
    plan = check_run(cfg, world_size, torch.cuda.is_available() or check_gpus, fresh_start=resume_dir is None)
    config_dict = cfg.to_dict()
    target = None
    if resume_dir is not None:  # (compared with the data of the checkpoint's own phase)
        target = checkpointer.plan_resume(resume_dir, config_dict, plan, world_size, cfg.data.shards_dir)
    if not check_only:  # a file, read-only or full location: one line and exit 4 now, not at the first save
        check_output_dir(Path(cfg.train.output_dir), world.rank)
        hold_run_dir(cfg.train.output_dir, world.rank)  # one writer per run directory (exit 2 naming the holder)
        exit_record.begin(Path(cfg.train.output_dir), world.rank == 0, name=cfg.name,  # run_state.json (cpt-status)
                          total_steps=cfg.train.total_steps, arch=cfg.model.arch, size=cfg.model.size)
    # identical initial weights on every rank, for any world size
    model = build_run_model(plan.schedule.run_config(plan.schedule.phases[0]), plan, warm_start=target is None)
    if target is not None:
        checkpointer.check_shapes(target, model)
    if check_only:
        start_from = f"warm start from {cfg.model.init_from}" if cfg.model.init_from else "fresh start"
        newer = f" (newer tags to set aside: {[p.name for p in target.set_aside]})" if target and target.set_aside else ""
        print(f"ok: {cfg.name}: {plan.batch}, ZeRO {plan.zero_stage}, "
              f"{'resume from ' + str(resume_dir) if resume_dir else start_from}{newer}")
        return 0
    with torch_process_state(cfg.train.deterministic, cfg.deepspeed.tf32):
        # built with the config and plan of the phase of the next step: its data, seed and batch
        run_cfg, run_plan = plan.schedule.start_view(plan, target.meta.step if target is not None else 0)
        run = start(run_cfg, run_plan, model, target, config_dict, recipe, checkpointer)
        return run.loop(preemption)
