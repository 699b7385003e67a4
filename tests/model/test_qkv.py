"""One fused QKV projection inside, Hugging Face's query / key / value at every boundary."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.hf_names import from_hf, to_hf
from pipeline.pretrain.build import build_pretrain_model
from pipeline.model.encoder import build_encoder_config, fuse_qkv, split_qkv

SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def model(objectives):
    cfg = build_encoder_config("tiny", vocab_size=61, max_position=24)
    return build_pretrain_model(cfg, objectives, SPECIAL, {}, seed=0, kernels="torch")


def test_one_gemm_projects_q_k_and_v(monkeypatch):
    shapes = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: shapes.append(tuple(w.shape)) or real(x, w, b))
    layer = model({"mlm": 1.0}).bert.encoder.layer[0]
    layer(torch.randn(2, 5, 64), None)
    assert shapes == [(192, 64), (64, 64), (128, 64), (64, 128)]  # qkv, attention output, FFN in, FFN out


def test_split_and_fuse_round_trip_a_state_dict_with_a_generator():
    state = model({"cocolm": 1.0}).state_dict()
    fused = [k for k in state if ".attention.self.qkv." in k]
    assert len(fused) == 2 * (2 + 1)  # weight + bias of 2 main layers and 1 generator layer
    hf = split_qkv(state)
    assert not any(".qkv." in k for k in hf)
    for key in fused:
        head, param = key.split("attention.self.qkv.")
        q, k, v = (hf[f"{head}attention.self.{n}.{param}"] for n in ("query", "key", "value"))
        assert q.shape[0] == k.shape[0] == v.shape[0] == 64
        assert torch.equal(torch.cat([q, k, v]), state[key])
    back = fuse_qkv(hf)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert fuse_qkv(state).keys() == state.keys()  # already fused: unchanged


def test_an_incomplete_triple_is_an_error_naming_the_missing_key():
    hf = split_qkv(model({"mlm": 1.0}).state_dict())
    del hf["bert.encoder.layer.1.attention.self.value.bias"]
    with pytest.raises(KeyError, match="layer.1.attention.self.value.bias"):
        fuse_qkv(hf)


def test_hf_boundary_names_and_round_trip():
    ours = model({"mlm": 1.0})
    state = ours.state_dict()
    hf = to_hf(state)
    assert "bert.encoder.layer.0.attention.self.query.weight" in hf and not any(".qkv." in k for k in hf)
    back, unused = from_hf(hf)
    assert unused == [] and set(back) == {k for k in state if k.startswith(("bert.", "cls."))}
    assert all(torch.equal(back[k], state[k]) for k in back)
    fresh = model({"mlm": 1.0})
    fresh.load_state_dict(back, strict=True)  # a warm start from Hugging Face names
