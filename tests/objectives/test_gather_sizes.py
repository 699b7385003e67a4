"""`all_gather_row_blocks` exchanges the ranks' row counts on a host (gloo) group: with an NCCL
default group the sizes never travel as device tensors read back with `.item()` (a device sync per
gather). Checked on two gloo ranks whose default group poses as NCCL, so the separate host group
is really created and used."""
from __future__ import annotations

import os

import pytest
import torch

from tests.gloo_ranks import spawn_gloo_ranks


def _rank_main(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    import pipeline.distributed as pd

    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else real_backend(group)  # pose as NCCL
    try:
        rows = torch.arange((rank + 2) * 3, dtype=torch.float32).reshape(rank + 2, 3) + 100 * rank
        blocks = pd.all_gather_row_blocks(rows)
        again = pd.all_gather_row_blocks(rows[:1])  # a second gather reuses the host group
        group = pd._HOST_GROUP.get("group")
        out = {"blocks": blocks, "again": again, "host_group": group is not None,
               "host_backend": real_backend(group) if group is not None else None}
        dist.barrier()
        if group is not None:  # gloo threads of a live group at interpreter exit can abort the process
            dist.destroy_process_group(group)
        pd._HOST_GROUP.clear()
    finally:
        dist.get_backend = real_backend
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gather_sizes_travel_on_a_host_group(tmp_path):
    spawn_gloo_ranks(_rank_main, 2, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    expected = [torch.arange((r + 2) * 3, dtype=torch.float32).reshape(r + 2, 3) + 100 * r for r in range(2)]
    for out in results:
        assert out["host_group"] and out["host_backend"] == "gloo"
        assert [b.shape[0] for b in out["blocks"]] == [2, 3]  # sizes differ between the ranks
        for block, ref in zip(out["blocks"], expected):
            assert torch.equal(block, ref)
        assert [b.shape[0] for b in out["again"]] == [1, 1]
