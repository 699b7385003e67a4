"""Rank-discovery probe: `init_distributed()` under any launcher, then one all_reduce.

Run by the launch and SLURM tests as `python -m tests.launch.dist_probe OUT_DIR`; each rank
writes `OUT_DIR/rank<R>.json` with what it discovered and the all-reduced sum, so a test can
check that ranks are distinct, the world size is right and the process group really talks.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.distributed import init_distributed


def main(out_dir: str) -> None:
    info = init_distributed(backend="gloo", timeout_s=120)
    value = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(value)  # sum over ranks of (rank + 1) = W (W + 1) / 2
    record = {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "launcher": info.launcher,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "all_reduce_sum": value.item(),
        "master_addr": os.environ["MASTER_ADDR"],
        "master_port": os.environ["MASTER_PORT"],
        "host": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{info.rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{info.rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.launch.dist_probe OUT_DIR")
    main(sys.argv[1])
