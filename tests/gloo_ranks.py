"""Collective tests on the CPU: the torch launcher variables, a free loopback port, and `world`
gloo ranks in child processes.

`spawn_gloo_ranks(body, world, *args)` runs `body(rank, *args)` on every rank inside an initialised
gloo process group (destroyed afterwards, also when `body` fails); `body` must be a module-level
function (it is pickled by reference into the children)."""
from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

#: What torchrun / `pipeline.distributed.init_distributed` export; a test's subprocess or job must
#: not inherit stale values of them (they win over SLURM's and MPI's ranks).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gloo_ranks(body: Callable[..., None], world: int, *args: Any) -> None:
    mp.spawn(_rank_entry, args=(body, world, free_port(), args), nprocs=world, join=True)


def _rank_entry(rank: int, body: Callable[..., None], world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, *args)
    finally:
        dist.destroy_process_group()
