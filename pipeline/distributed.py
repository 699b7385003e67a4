"""Rank discovery and process-group set-up for every launcher we support.

One process (no launcher), `torchrun`, the `deepspeed` launcher, `srun` (SLURM) and `mpirun`
(MPICH / Open MPI, optionally through `mpi4py`) all end up here. Discovery order:

1. `RANK`/`WORLD_SIZE`/`LOCAL_RANK` (torchrun, deepspeed launcher, or set by our sbatch script);
2. MPI: `PMI_RANK`/`PMI_SIZE` (MPICH/Hydra), `OMPI_COMM_WORLD_*` (Open MPI). These come before
   SLURM because `mpirun` inside an allocation starts its proxies with `srun`, so the ranks also
   inherit the proxy step's `SLURM_PROCID` (one per node, not per rank): the innermost launcher wins;
3. SLURM: `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`, only inside an `srun` step
   (`SLURM_STEP_ID` set; the batch script itself is one process whatever `SLURM_NTASKS` says);
4. otherwise a single process.

The rendezvous address is `MASTER_ADDR`/`MASTER_PORT` when set (our sbatch script exports them
once per job); under SLURM otherwise the `NodeAddr` of the first host of the step's node list
(node names need not resolve, the address SLURM itself uses does) and a port derived from the job
and step ids; under MPI rank 0's hostname and a free port of rank 0, broadcast with mpi4py when available.

On the CPU, DeepSpeed's process group wants a C++ communication op it compiles on first use
(`cpu_comm_op`): a single process does without it (nothing compiled), several ranks are told before
it is built, once per Python environment.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "single" | "env" | "slurm" | "mpi"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _first_slurm_host() -> str:
    """Address of the step's first node: its SLURM `NodeAddr`, else its name."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        first = out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        # Plain names ("node1,node2") work without scontrol.
        return nodelist.split(",")[0]
    try:
        node = subprocess.run(["scontrol", "show", "node", "-o", first], capture_output=True, text=True, check=True)
        match = re.search(r"\bNodeAddr=(\S+)", node.stdout)
        return match.group(1) if match else first
    except (OSError, subprocess.CalledProcessError):
        return first


def discover(env: dict[str, str] | None = None) -> DistInfo:
    """Rank, world size and local rank from the launcher's environment (no side effects)."""
    e = os.environ if env is None else env
    if "RANK" in e and "WORLD_SIZE" in e:
        return DistInfo(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)), "env")
    if "PMI_RANK" in e and "PMI_SIZE" in e:
        local = int(e.get("MPI_LOCALRANKID", e.get("PMI_LOCAL_RANK", 0)))
        return DistInfo(int(e["PMI_RANK"]), int(e["PMI_SIZE"]), local, "mpi")
    if "OMPI_COMM_WORLD_RANK" in e:
        return DistInfo(
            int(e["OMPI_COMM_WORLD_RANK"]),
            int(e["OMPI_COMM_WORLD_SIZE"]),
            int(e.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
            "mpi",
        )
    # Only a task of an srun step is a rank: the batch script itself also sees SLURM_PROCID=0 and
    # the job's SLURM_NTASKS, but no step id (treating it as rank 0 of N would hang in rendezvous).
    if "SLURM_PROCID" in e and ("SLURM_STEP_ID" in e or "SLURM_STEPID" in e):
        return DistInfo(int(e["SLURM_PROCID"]), int(e.get("SLURM_NTASKS", "1")), int(e.get("SLURM_LOCALID", 0)), "slurm")
    return DistInfo(0, 1, 0, "single")


def _mpi_rendezvous() -> tuple[str, str]:
    """Rank 0's hostname and a free port on it, broadcast to every rank with mpi4py.

    Without mpi4py, ranks cannot agree on anything but fixed values (one host, port 29500).
    """
    try:
        from mpi4py import MPI
    except ImportError:
        return "127.0.0.1", "29500"
    comm = MPI.COMM_WORLD
    mine = (socket.gethostname(), _free_port()) if comm.Get_rank() == 0 else None
    return comm.bcast(mine, root=0)


def init_distributed(backend: str | None = None, timeout_s: int = 1800) -> DistInfo:
    """Discover ranks, export the torch env variables, and initialise the process group.

    backend: "nccl" | "gloo" | None (nccl with CUDA, gloo otherwise). Single-process runs also get
    a (world size 1) process group, because DeepSpeed's engine expects one.
    timeout_s: how long any collective may wait for the other ranks (`train.dist_timeout_s`): a
    dead or hung rank makes the others fail after this long instead of hanging (gloo raises;
    NCCL's watchdog aborts the process, `TORCH_NCCL_ASYNC_ERROR_HANDLING`, set here unless given).
    """
    import datetime

    import deepspeed

    info = discover()
    if info.launcher == "mpi" and ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        addr, port = _mpi_rendezvous()  # collective: every rank calls it, whatever it lacks
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", port)
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = _first_slurm_host() if info.launcher == "slurm" else "127.0.0.1"
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = _slurm_port() if info.launcher == "slurm" else "29500"
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # abort a rank whose collective timed out
    timeout = datetime.timedelta(seconds=timeout_s)
    # Process groups created later without a timeout (DeepSpeed's data-parallel groups, through
    # `new_group`) take torch's module default (30 min gloo / 10 min NCCL), not the default group's:
    # make that default ours, so every collective of the run is bounded by `timeout_s`.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    if info.world_size == 1 and not torch.distributed.is_initialized():
        # One process needs no rendezvous: an in-memory store instead of a TCP port, so concurrent
        # single-process runs on one machine can never race for the same free port.
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                                             timeout=timeout)
    if not torch.distributed.is_initialized() or not deepspeed.comm.is_initialized():
        with cpu_comm_op(info.world_size, info.rank):
            deepspeed.init_distributed(
                dist_backend=backend,
                auto_mpi_discovery=False,
                timeout=timeout,
                rank=info.rank,
                world_size=info.world_size,
            )
    return info


@contextlib.contextmanager
def cpu_comm_op(world_size: int, rank: int) -> Iterator[None]:
    """Around `deepspeed.init_distributed` on the CPU accelerator, whose backend JIT-builds its shared-memory
    all-reduce (`capabilities.SHM_COMM_OP`, g++) the first time: ~100 s on an idle machine, minutes on a busy
    one, silent. One process has no other rank to all-reduce with, so the op is not built: DeepSpeed skips an op
    its `deepspeed.ops.__compatible_ops__` marks incompatible (the dict it keeps for that; restored after).
    Several ranks need it: before an unbuilt op is built, rank 0 says so, that it happens once per Python
    environment, and where it is cached. Nothing changes on a GPU (no such op there)."""
    from deepspeed.accelerator import get_accelerator

    from pipeline.capabilities import SHM_COMM_OP, extensions_dir, op_built

    if get_accelerator().device_name() != "cpu":
        yield
        return
    if world_size > 1:
        if rank == 0 and not op_built(SHM_COMM_OP):
            log.warning("DeepSpeed now builds its CPU communication op (%s) with g++ for the %d ranks: once per "
                        "Python environment (about 2 minutes on an idle machine, longer on a busy one), cached in "
                        "%s; later runs start at once", SHM_COMM_OP, world_size, extensions_dir() / SHM_COMM_OP)
        yield
        return
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    before = compatible.get(SHM_COMM_OP, False)
    compatible[SHM_COMM_OP] = False  # one process: `build_shm_op` returns None, nothing is compiled
    try:
        yield
    finally:
        compatible[SHM_COMM_OP] = before


def shutdown_distributed() -> bool:
    """Destroy the default process group, if this process made one, before the interpreter tears down;
    returns whether there was one.

    Without it a gloo rank can abort at exit (SIGABRT, "terminate called without an active
    exception"): gloo's worker threads still hold work objects whose tensors reach back into Python
    while the interpreter is being finalised (pytorch/pytorch#190489). A finished 2-rank run then
    reports exit 134 on one rank although it completed. Local, no collective: safe on error paths.
    Destroying is not always enough: groups that DeepSpeed still references (ZeRO-3's partition
    groups) keep their gloo threads until finalisation, so the entry point also ends the process
    without finalising (`pipeline.train.__main__`).
    """
    import torch.distributed as dist

    made = dist.is_available() and dist.is_initialized()
    if made:
        dist.destroy_process_group()  # every group, the host group of `_gather_host_sizes` included
    _HOST_GROUP.clear()  # and no reference to it outlives the process group
    return made


def _slurm_port() -> str:
    """A port every rank of one srun step computes alike: from the job and step ids, so
    consecutive steps of a job (a benchmark sweep) do not reuse a port still in TIME_WAIT."""
    job = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
    step = int(os.environ.get("SLURM_STEP_ID", "0") or 0)
    return str(20000 + (job * 64 + step) % 40000)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("", 0))
        return str(s.getsockname()[1])



# --------------------------------------------------------------------------------------------
# Collectives (the one home of every cross-rank operation; each is a no-op on one process)
# --------------------------------------------------------------------------------------------
def multi_rank() -> bool:
    """True inside an initialised process group of more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if multi_rank():
        torch.distributed.barrier()


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if not multi_rank():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def first_problem(problem: str) -> str:
    """The first non-empty `problem` of any rank (in rank order), on every rank; "" when none.
    Lets every rank fail with the same message when one rank found something wrong."""
    if not multi_rank():
        return problem
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, problem)
    return next((p for p in gathered if p), "")


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """In-place sum of `values` over the ranks (returned for chaining)."""
    if multi_rank():
        torch.distributed.all_reduce(values)
    return values


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group; (0, 1) without one."""
    if not multi_rank():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def all_gather_row_blocks(rows: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `rows` [n, D] (n may differ between ranks), one block per rank in rank order;
    `[rows]` on one process. Gathered blocks carry no autograd history: pass detached rows."""
    if not multi_rank():
        return [rows]
    dist = torch.distributed
    world = dist.get_world_size()
    sizes_int = _gather_host_sizes(rows.shape[0], world)
    padded = rows.new_zeros((max(sizes_int), rows.shape[1]))
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded.contiguous())
    return [g[:s] for g, s in zip(gathered, sizes_int)]


_HOST_GROUP: dict[str, Any] = {}


def _host_group() -> Any:
    """A gloo process group over the same ranks (None: the default group is gloo already), for
    exchanging host numbers without touching the device. Created on first use, which every rank
    reaches at the same collective (`all_gather_row_blocks` is called by all ranks alike)."""
    dist = torch.distributed
    if dist.get_backend() == "gloo":
        return None
    default = dist.group.WORLD  # a new default group (a re-initialised process) needs a new gloo group
    if _HOST_GROUP.get("default") is not default:
        _HOST_GROUP.update(default=default, group=dist.new_group(backend="gloo"))
    return _HOST_GROUP["group"]


def _gather_host_sizes(n: int, world: int) -> list[int]:
    """Every rank's row count `n`, exchanged on the host (gloo, CPU tensors): the sizes are host
    numbers, so gathering them as device tensors and reading them back (`.item()`) would make the
    host wait for the device at every gather."""
    mine = torch.tensor([n], dtype=torch.long)
    sizes = [torch.zeros_like(mine) for _ in range(world)]
    torch.distributed.all_gather(sizes, mine, group=_host_group())
    return [int(s[0]) for s in sizes]


def all_gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Concatenate `rows` [n, D] of every rank in rank order (n may differ between ranks)."""
    if not multi_rank():
        return rows
    return torch.cat(all_gather_row_blocks(rows), dim=0)


def split_own_block(blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's block, the other ranks' blocks concatenated in rank order) of
    `all_gather_row_blocks`' result: the rows a rank adds as constant "other ranks" negatives."""
    rank, _ = rank_and_world()
    others = [b for r, b in enumerate(blocks) if r != rank]
    own = blocks[rank]
    return own, (torch.cat(others, dim=0) if others else own[:0])


#: Words by which gloo / c10d report a collective that another rank did not complete.
_LOST_PEER_MARKERS = ("connection closed by peer", "connection reset by peer", "timed out waiting", "[gloo",
                      "broken pipe")


def lost_ranks_message(err: BaseException, timeout_s: int, grace_s: float = 5.0) -> str:
    """One line for a collective that failed because another rank died or hung, or "" when `err` is
    something else (then it is raised as it is).

    A dead rank (killed, crashed) makes the others' next collective fail at once (gloo: "connection
    closed by peer"); a hung one (stopped, deadlocked) makes it fail after `train.dist_timeout_s`.
    To name the lost rank, every rank whose collective failed writes `cpt/failed/<rank>` to the
    job's rendezvous store (c10d TCP store, on rank 0) and waits up to `grace_s` for the others':
    the ranks that never write are the ones that stopped answering. When rank 0 itself is gone,
    its store is too, and that is what the line says. NCCL (GPU) does not come here: its watchdog
    aborts the process after the same timeout (`TORCH_NCCL_ASYNC_ERROR_HANDLING`)."""
    import time

    if not multi_rank():
        return ""
    text = str(err).strip()
    distributed_error = isinstance(err, getattr(torch.distributed, "DistError", ()))
    if not distributed_error and not any(marker in text.lower() for marker in _LOST_PEER_MARKERS):
        return ""
    rank, world = rank_and_world()
    reason = text.splitlines()[0][:160] if text else type(err).__name__
    try:
        import torch.distributed.distributed_c10d as c10d

        store = c10d._get_default_store()
        store.set(f"cpt/failed/{rank}", "1")
        waiting, deadline = [r for r in range(world) if r != rank], time.monotonic() + grace_s
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not store.check([f"cpt/failed/{r}"])]
            time.sleep(0.05)
        lost = (f"rank(s) {waiting} stopped answering (killed, crashed or hung)" if waiting else
                "every rank saw the failure (a network problem?)")
    except Exception:  # noqa: BLE001 - the store lives on rank 0: unreachable means rank 0 is gone
        lost = "rank 0 stopped answering (its rendezvous store is unreachable: killed, crashed or hung)"
    return (f"rank {rank}: a collective with the other ranks failed: {lost}; a dead rank ends the job at its next "
            f"collective, a hung one after train.dist_timeout_s={timeout_s}s ({reason})")
