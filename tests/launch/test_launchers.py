"""Every launcher command of docs/training.md's launcher section, run as written (CPU, gloo, 2 ranks).

The commands are read from the docs, not retyped: only the GPU count, the node address and port,
the preset and the shard path are substituted (8 -> 2 or 1 per node, node0 -> 127.0.0.1, taco-small
-> tiny-mlm), and the tiny run's overrides appended. Two "nodes" are two launcher processes on this
machine. All of them must give the same per-step losses (same global batch, same world size 2).
`mpirun` and `srun` are covered by tests/launch/test_mpirun.py and tests/slurm/.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.train.cli import parse_args
from tests.gloo_ranks import LAUNCHER_VARIABLES, free_port

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "training.md"
RUN = ["train.total_steps=3", "optim.warmup_steps=1", "train.progress_bar=false", "train.tensorboard=false",
       "train.log_every=1"]


def documented(prefix: str) -> list[str]:
    """The one command line of docs/training.md that starts with `prefix`, as tokens."""
    lines = [line.strip() for line in DOCS.read_text().splitlines() if line.strip().startswith(prefix)]
    assert len(lines) == 1, f"docs/training.md: expected one command starting {prefix!r}, found {lines}"
    return shlex.split(lines[0].split("  #")[0])


def substitute(tokens: list[str], shards: Path, out: Path, **subs: str) -> list[str]:
    """Replace the docs' placeholders: whole tokens in `subs` (and `node0` inside host:port)."""
    table = {"taco-small": "tiny-mlm", "data.shards_dir=shards/": f"data.shards_dir={shards}", **subs}
    return [table.get(t, t) for t in tokens] + [f"train.output_dir={out}", *RUN]


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    return {**clean, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_all(commands: list[list[str]], timeout: float = 400) -> None:
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for cmd, proc, text in zip(commands, procs, outputs):
        assert proc.returncode == 0, f"{shlex.join(cmd)} failed ({proc.returncode}):\n{text[-4000:]}"


def losses_and_world(out: Path) -> tuple[dict[int, float], int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    meta = json.loads((out / "checkpoints" / "step_00000003" / "pipeline_meta.json").read_text())
    return {r["step"]: r["loss"] for r in rows}, meta["world_size"]


def test_local_rank_flag_is_accepted_and_agrees_with_the_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = parse_args(["--local_rank=1", "--config", "tiny-mlm"])
    assert args.local_rank == 1 and os.environ["LOCAL_RANK"] == "1"
    assert parse_args(["--local-rank", "1", "--config", "tiny-mlm"]).local_rank == 1
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as err:
        parse_args(["--local_rank=1", "--config", "tiny-mlm"])
    assert err.value.code == 2


@pytest.fixture(scope="module")
def deepspeed_two_gpus(tiny_shards_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, int]:
    """`deepspeed --num_gpus 2 --module pipeline.train ...`: on a CPU machine, two gloo ranks."""
    out = tmp_path_factory.mktemp("deepspeed_num_gpus")
    cmd = substitute(documented("deepspeed --num_gpus"), tiny_shards_dir, out,
                     **{"8": "2"})
    cmd[cmd.index("--num_gpus") + 2:cmd.index("--num_gpus") + 2] = ["--master_port", str(free_port())]
    run_all([[sys.executable, "-m", "deepspeed.launcher.runner", *cmd[1:]]])
    return losses_and_world(out)


@pytest.mark.slow
def test_deepspeed_launcher_as_documented(deepspeed_two_gpus):
    losses, world = deepspeed_two_gpus
    assert world == 2 and sorted(losses) == [1, 2, 3]


@pytest.mark.slow
def test_two_torchrun_nodes_meet_at_a_rendezvous(tiny_shards_dir, tmp_path, deepspeed_two_gpus):
    endpoint = f"127.0.0.1:{free_port()}"
    line = documented("torchrun --nnodes")
    cmd = substitute(line, tiny_shards_dir, tmp_path, **{"8": "1", "node0:29500": endpoint, "run1": tmp_path.name})
    node = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
    run_all([node, node])  # the same command on both "nodes"
    assert losses_and_world(tmp_path) == deepspeed_two_gpus


@pytest.mark.slow
def test_two_deepspeed_nodes_from_a_hostfile_without_ssh(tiny_shards_dir, tmp_path, deepspeed_two_gpus):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")  # names only: --no_ssh never contacts them
    out = tmp_path / "run"
    port = str(free_port())
    line = documented("deepspeed --hostfile hostfile --no_ssh")
    nodes = []
    for rank in ("0", "1"):
        cmd = substitute(line, tiny_shards_dir, out, hostfile=str(hostfile), node0="127.0.0.1", **{"29500": port})
        cmd[cmd.index("--node_rank") + 1] = rank
        nodes.append([sys.executable, "-m", "deepspeed.launcher.runner", *cmd[1:]])
    run_all(nodes)
    assert losses_and_world(out) == deepspeed_two_gpus
