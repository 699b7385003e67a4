"""`optim.name=stable_adamw` (issue 38): equal to a reference loop written here from Wortsman et al.
2023's Algorithm 2, and resumed bit for bit through DeepSpeed's client-optimizer path under ZeRO 1,
2 and 3 (tiny-mlm, CPU, fp32)."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.train.optim import OptimConfig, build_optimizer, resolve_impl
from pipeline.train.stable_adamw import StableAdamW
from tests.train.runs import metric_rows, run_inprocess, tag_dir

BETAS, EPS, WD = (0.9, 0.98), 1e-6, 0.1


def reference(params: list[torch.Tensor], grads: list[list[torch.Tensor]], lrs: list[float]) -> tuple[list[torch.Tensor], list[bool]]:
    """The paper's equations, element by element in Python floats over float64 tensors: per tensor,
    β̂ = β(1-β^(t-1))/(1-β^t); m, v with β̂; RMS = sqrt(mean(g²/max(v, ε²))); η̂ = η/max(1, RMS);
    θ ← θ - η̂λθ - η̂ m/(sqrt(v)+ε). Returns the parameters and whether each step clipped somewhere."""
    theta = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    clipped = []
    for t, (step_grads, lr) in enumerate(zip(grads, lrs), start=1):
        hat = [b * (1 - b ** (t - 1)) / (1 - b ** t) for b in BETAS]
        any_clip = False
        for i, g in enumerate(step_grads):
            m[i] = hat[0] * m[i] + (1 - hat[0]) * g
            v[i] = hat[1] * v[i] + (1 - hat[1]) * g * g
            rms = math.sqrt(float(torch.mean(g * g / torch.clamp(v[i], min=EPS * EPS))))
            any_clip |= rms > 1
            rate = lr / max(1.0, rms)
            theta[i] = theta[i] - rate * WD * theta[i] - rate * m[i] / (torch.sqrt(v[i]) + EPS)
        clipped.append(any_clip)
    return theta, clipped


def test_equals_the_papers_reference_loop():
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (8,), (3, 4, 5)]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = []
    for t in range(12):
        scale = 50.0 if t == 7 else 1.0  # a gradient spike: v lags behind g, RMS > 1, the step is clipped
        grads.append([scale * torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes])
    lrs = [1e-2 * (t + 1) / 12 for t in range(12)]
    expected, clipped = reference(params, grads, lrs)
    assert clipped[7] and not clipped[0]  # t = 1: v = g², RMS = 1 exactly: no clip

    live = [torch.nn.Parameter(p.clone()) for p in params]
    opt = StableAdamW(live, lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=WD)
    for step_grads, lr in zip(grads, lrs):
        for p, g in zip(live, step_grads):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    for got, want in zip(live, expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-15)

    # without the clip (AdamW with the same moments) the spike's step would differ: the test can fail
    unclipped = [torch.nn.Parameter(p.clone()) for p in params]
    adamw = torch.optim.AdamW(unclipped, lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=WD)
    for step_grads, lr in zip(grads, lrs):
        for p, g in zip(unclipped, step_grads):
            p.grad = g.clone()
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
    assert not torch.allclose(unclipped[0].detach(), expected[0], rtol=1e-6)


def test_per_tensor_step_counts_survive_a_state_dict_round_trip():
    """The step lives in each tensor's state (not the group's), so a save/load mid-run and a caller
    that steps groups separately (ZeRO 3's sub-groups) keep the bias correction right."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.nn.Parameter(torch.randn(4, 4, generator=gen)), torch.nn.Parameter(torch.randn(4, generator=gen))
    grads = [(torch.randn(4, 4, generator=gen), torch.randn(4, generator=gen)) for _ in range(6)]

    def run(split: bool) -> list[torch.Tensor]:
        x, y = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
        opt = StableAdamW([{"params": [x]}, {"params": [y], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)
        for i, (gx, gy) in enumerate(grads):
            x.grad, y.grad = gx.clone(), gy.clone()
            if split:  # ZeRO 3 style: one group's params at a time, the other group empty
                groups = [g["params"] for g in opt.param_groups]
                for keep in range(2):
                    for j, g in enumerate(opt.param_groups):
                        g["params"] = groups[j] if j == keep else []
                    opt.step()
                for j, g in enumerate(opt.param_groups):
                    g["params"] = groups[j]
            else:
                opt.step()
            if i == 2:  # save and reload mid-run
                state = opt.state_dict()
                opt = StableAdamW([{"params": [x]}, {"params": [y], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)
                opt.load_state_dict(state)
        return [x.detach(), y.detach()]

    whole, split = run(False), run(True)
    assert all(torch.equal(p, q) for p, q in zip(whole, split))


def test_built_from_the_config_and_refused_where_it_cannot_run():
    model = torch.nn.Linear(4, 4)
    cfg = OptimConfig(name="stable_adamw", lr=1e-3, betas=BETAS, eps=EPS, weight_decay=WD)
    cfg.check()
    opt = build_optimizer(model, cfg, "cpu")
    assert isinstance(opt, StableAdamW) and resolve_impl(cfg, "cuda", False) == "torch"
    assert [g["weight_decay"] for g in opt.param_groups] == [WD, 0.0]  # no decay on the bias
    from pipeline.config.checks import ConfigError

    with pytest.raises(ConfigError, match="offload_optimizer steps with DeepSpeedCPUAdam"):
        build_optimizer(model, cfg, "cpu", offload=True)


STEPS = ["train.total_steps=4", "train.checkpoint_every=2", "train.keep_last=3", "optim.name=stable_adamw"]


@pytest.mark.parametrize("engine", ["zero1", "zero2", "zero3"])
def test_resume_is_bitwise_exact_under_zero(engine, tiny_shards_dir, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    extra = [f"deepspeed.config={engine}"]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, full, *STEPS, *extra) == 0
    assert run_inprocess("tiny-mlm", tiny_shards_dir, resumed, *STEPS, *extra, f"train.resume={tag_dir(full, 2)}") == 0
    expected, got = metric_rows(full), metric_rows(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == expected[step], f"{engine}: step {step} differs after resume"
    assert expected[3]["loss"] != expected[4]["loss"]
    # the run really stepped StableAdamW: DeepSpeed saved its param groups (torch's AdamW adds amsgrad,
    # foreach, fused, ...) and its per-tensor state
    saved = torch.load(tag_dir(full, 4) / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu",
                       weights_only=False)
    groups, states = find_key(saved, "param_groups"), find_key(saved, "state")
    assert groups and all(set(g) == {"lr", "betas", "eps", "weight_decay", "params"} for g in groups)
    assert states and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} and int(s["step"]) == 4 for s in states.values())


def find_key(tree, key):
    """The first value under `key` in nested dicts/lists (where DeepSpeed keeps the client optimizer's state dict)."""
    if isinstance(tree, dict):
        if key in tree and tree[key]:
            return tree[key]
        children = tree.values()
    elif isinstance(tree, (list, tuple)):
        children = tree
    else:
        return None
    for child in children:
        found = find_key(child, key)
        if found is not None:
            return found
    return None
