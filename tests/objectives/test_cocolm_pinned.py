"""COCO-LM's exact numbers, pinned: the values one fixed step gives on the tiny model before the
auxiliary generator, its sampling and the replaced-token labels moved to the home they share with
ELECTRA (`pipeline.objectives.replaced_tokens`). A refactor that changes any draw, label, loss term
or gradient of COCO-LM fails here, while the behavioural tests would still pass.

The pins were measured on the CPU (torch's CPU generator, fp32); the tolerance is a few float32
ulps of summation order, far below what a changed draw or label moves (a different replacement at
one position moves `copy_loss` in the third digit).
"""
from __future__ import annotations

import pytest
import torch

from pipeline.model.modernbert import MODERNBERT_SIZES, ModernBertConfig
from pipeline.pretrain.pretrainer import PretrainModel
from tests.objectives.conftest import SPECIAL, VOCAB, make_batch, tiny_model

#: (options, arch) -> (total loss, the objective's loss terms, sum of |grad| over every parameter)
PINNED = {
    ("paper", "bert"): (46.00151824951172, {"gen_loss": 4.58025312, "copy_loss": 0.6852656,
                                             "clm_lm_loss": 5.21755362, "scl_loss": 1.94043374,
                                             "rtd_auc": 0.59610391, "clm_copy_penalty": 0.68082738,
                                             "clm_softmax_ce": 4.536726}, 3283.379331922476),
    ("tiny", "bert"): (12.448986053466797, {"gen_loss": 4.57672691, "copy_loss": 0.68908221,
                                             "clm_lm_loss": 5.21959734, "scl_loss": 1.96357894,
                                             "rtd_auc": 0.53246754, "clm_copy_penalty": 0.69446379,
                                             "clm_softmax_ce": 4.52513456}, 492.1915078512649),
    ("paper", "modernbert"): (46.076515197753906, {"gen_loss": 4.57030201, "copy_loss": 0.68585712,
                                                   "clm_lm_loss": 5.26746273, "scl_loss": 1.94589663,
                                                   "rtd_auc": 0.56623375, "clm_copy_penalty": 0.68299049,
                                                   "clm_softmax_ce": 4.58447218}, 1906.7990160825934),
    ("tiny", "modernbert"): (12.469518661499023, {"gen_loss": 4.57030201, "copy_loss": 0.68585712,
                                                  "clm_lm_loss": 5.26746273, "scl_loss": 1.94589663,
                                                  "rtd_auc": 0.56623375, "clm_copy_penalty": 0.68299049,
                                                  "clm_softmax_ce": 4.58447218}, 599.4977141164563),
}
OPTIONS = {"paper": {}, "tiny": {"sample_mode": "zero_dropout", "sample_temperature": 2.0, "lambda_copy": 1.0,
                                 "generator_layers": 1}}


def _model(options: dict, arch: str) -> PretrainModel:
    if arch == "bert":
        return tiny_model({"cocolm": 1.0}, {"cocolm": options})
    torch.manual_seed(0)
    config = ModernBertConfig(**MODERNBERT_SIZES["tiny"], vocab_size=VOCAB, max_position=64)
    return PretrainModel(config, {"cocolm": 1.0}, SPECIAL, objective_options={"cocolm": options}, seed=0,
                         kernels="torch")


def _step(options: dict, arch: str) -> tuple[float, dict[str, float], float]:
    model = _model(options, arch)
    loss, metrics = model(make_batch(seed=3), sampling_seed=7)
    loss.backward()
    grad = sum(p.grad.double().abs().sum() for p in model.parameters() if p.grad is not None)
    return loss.item(), {k.split("/", 1)[1]: v.item() for k, v in metrics.items() if k.startswith("cocolm/")}, float(grad)


@pytest.mark.parametrize("key", sorted(PINNED))
def test_cocolm_step_equals_its_pinned_values(key):
    loss, terms, grad = PINNED[key]
    got_loss, got_terms, got_grad = _step(OPTIONS[key[0]], key[1])
    assert got_loss == pytest.approx(loss, rel=2e-6)
    for name, value in terms.items():
        assert got_terms[name] == pytest.approx(value, rel=2e-6, abs=1e-7), name
    assert got_grad == pytest.approx(grad, rel=1e-5)
    assert _step(OPTIONS[key[0]], key[1]) == (got_loss, got_terms, got_grad)  # and bit for bit reproducible

