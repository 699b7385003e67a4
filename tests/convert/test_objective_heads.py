"""`objective_heads.safetensors` records how to rebuild every head, and the documented loader does.

A tiny `PretrainModel` per objective with heads (CAPT's aggregation MLP, COCO-LM's copy and SCL
heads) is sorted by the converter's own `split_for_hf` and written by the converter's writer; the
loader rebuilds each head (a newly constructed objective, other initial weights) and must give the
original module's outputs."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pipeline.export.hf_adapter import split_for_hf
from pipeline.export.objective_heads import (
    OBJECTIVE_HEADS_FILE,
    ObjectiveHeadsError,
    load_objective_heads,
    write_objective_heads,
)
from pipeline.pretrain.build import build_pretrain_model
from pipeline.model.encoder import build_encoder_config
from pipeline.train.run_meta import RunMeta

SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
CASES = {
    "capt": ({"mlm": 1.0, "capt": 1.0}, {"capt": {"queue_size": 16, "tau": 0.1}},
             {"capt.aggregation": ("pipeline.objectives.capt.AggregationMLP", {"dense.weight": [128, 64]})}),
    "cocolm": ({"cocolm": 1.0}, {"cocolm": {"generator_layers": 1}},
               {"cocolm.copy_head": ("torch.nn.modules.linear.Linear", {"weight": [1, 64], "bias": [1]}),
                "cocolm.scl_head": ("pipeline.objectives.cocolm.SCLHead", {"dense.weight": [64, 64]})}),
}


def _write(tmp_path, objectives, options, seed=3):
    encoder = build_encoder_config("tiny", vocab_size=61, max_position=24)
    model = build_pretrain_model(encoder, objectives, SPECIAL, options, seed=seed, kernels="torch").eval()
    export = split_for_hf(model, model.state_dict())
    meta = RunMeta(encoder_config=encoder.to_dict(), objectives=objectives, objective_options=options,
                   special_tokens=SPECIAL, tokenizer_dir="", data_dir="", manifest_hash="", config_hash="", config={})
    write_objective_heads(tmp_path / OBJECTIVE_HEADS_FILE, model, export.objective_heads, meta)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_loader_rebuilds_every_head_with_the_same_outputs(case, tmp_path):
    objectives, options, expected = CASES[case]
    model = _write(tmp_path, objectives, options)
    with safe_open(str(tmp_path / OBJECTIVE_HEADS_FILE), framework="pt") as f:
        info = json.loads(f.metadata()["pipeline"])
    assert sorted(info["heads"]) == sorted(expected)
    for name, (cls, shapes) in expected.items():
        head = info["heads"][name]
        assert head["class"] == cls and head["objective"] == name.split(".")[0]
        assert all(head["parameters"][k] == v for k, v in shapes.items())
        assert head["structure"] and head["description"]
    assert info["objective_options"] == options and info["encoder_config"]["hidden_size"] == 64

    torch.manual_seed(123)  # the loader's fresh objective gets other initial weights than `model`
    heads = load_objective_heads(tmp_path)
    assert sorted(heads) == sorted(expected)
    x = torch.randn(5, 64)
    for name, module in heads.items():
        objective, attr = name.split(".")
        original = model.objectives[objective].get_submodule(attr)
        assert type(module) is type(original) and not module.training
        with torch.no_grad():
            torch.testing.assert_close(module(x), original(x), rtol=0, atol=0)


def test_loaded_values_come_from_the_file(tmp_path):
    """Two models with different initial weights write different files; each loads back its own."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _write(tmp_path / "a", *CASES["capt"][:2], seed=1)
    b = _write(tmp_path / "b", *CASES["capt"][:2], seed=2)
    x = torch.randn(3, 64)
    with torch.no_grad():
        ya, yb = (load_objective_heads(tmp_path / d)["capt.aggregation"](x) for d in "ab")
        torch.testing.assert_close(ya, a.objectives["capt"].aggregation(x), rtol=0, atol=0)
        torch.testing.assert_close(yb, b.objectives["capt"].aggregation(x), rtol=0, atol=0)
    assert not torch.allclose(ya, yb)


def test_a_file_without_the_recipe_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"objectives.capt.aggregation.dense.weight": torch.zeros(2, 2)}, str(tmp_path / OBJECTIVE_HEADS_FILE),
              metadata={"format": "pt", "pipeline": json.dumps({"objectives": {"capt": 1.0}})})
    with pytest.raises(ObjectiveHeadsError, match="written by another version"):
        load_objective_heads(tmp_path)
