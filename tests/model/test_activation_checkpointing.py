"""`model.activation_checkpointing`: the checkpointed layers recompute their activations in backward
with the dropout RNG replayed, so losses and gradients equal the run without it bit for bit on the CPU
(tolerance 0: `torch.equal`), for every objective and both families, on the unpadded (varlen) and the
dense/masked paths, eager and compiled, and a ZeRO-3 training run logs the same metrics; bad values are
refused naming the field before any compute."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import load_config
from pipeline.data.corruption import CorruptionCollator
from pipeline.pretrain.build import build_pretrain_model
from pipeline.model.checkpointing import checkpoint_period, describe, is_checkpointed
from pipeline.model.encoder import build_encoder_config
from pipeline.model.modernbert import MODERNBERT_SIZES, ModernBertConfig
from tests.train.runs import metric_rows, run_inprocess

SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
VOCAB, LENGTH, LAYERS = 71, 32, 3
OBJECTIVES = ("mlm", "mlm-nce", "taco", "capt", "cocolm", "electra", "infoword")
OPTIONS = {"cocolm": {"generator_layers": 2}, "electra": {"generator_width": 0.5}, "capt": {"queue_size": 0}, "infoword": {"num_negatives": 8},
           "taco": {"num_negatives": 8}}


def encoder(arch: str):
    """3 layers (so k=2 checkpoints layers 0 and 2, not 1), dropout on in the embeddings, the attention
    probabilities and the layers' outputs."""
    if arch == "bert":
        return build_encoder_config("tiny", vocab_size=VOCAB, max_position=LENGTH, num_layers=LAYERS,
                                    dropout=0.1, attention_dropout=0.1)
    shape = {**MODERNBERT_SIZES["tiny"], "num_layers": LAYERS, "local_attention": 8}  # window < row: local layers differ
    return ModernBertConfig(**shape, vocab_size=VOCAB, max_position=LENGTH, dropout=0.1, attention_dropout=0.1)


def make(arch: str, objective: str, setting: str, attention: str = "auto", compile_layers: bool = False):
    model = build_pretrain_model(encoder(arch), {objective: 1.0}, SPECIAL, {objective: OPTIONS.get(objective, {})},
                                 seed=3, kernels="torch", attention=attention, compile_layers=compile_layers,
                                 activation_checkpointing=setting)
    return model.train()


def batch(model, padded: bool = True):
    """A collated micro-batch; with `padded`, the last row ends early (the varlen path unpads it)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, size=(4, LENGTH))
    ids[:, 0], ids[:, -1] = SPECIAL["cls"], SPECIAL["sep"]
    if padded:
        ids[-1, 20:] = SPECIAL["pad"]
        ids[-1, 19] = SPECIAL["sep"]
    collator = CorruptionCollator(model.views, SPECIAL, VOCAB, seed=1, plans=model.host_plans())
    return collator.collate(ids, rng.random((4, LENGTH)) < 0.7, np.arange(4))


def layer_calls(model) -> dict[str, int]:
    """Counts of the forward calls under autograd per layer module (a checkpointed layer runs twice per
    such pass; passes under `no_grad`, e.g. a generator's sampling pass, save nothing and are not counted)."""
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.endswith(tuple(f"layer.{i}" for i in range(LAYERS))) or name.endswith(tuple(f"layers.{i}" for i in range(LAYERS))):
            calls[name] = 0
            module.register_forward_pre_hook(
                lambda m, a, name=name: calls.__setitem__(name, calls[name] + torch.is_grad_enabled()))
    return calls


def step(model, b):
    """Loss, every gradient and the global RNG state after one forward + backward from a fixed seed."""
    torch.manual_seed(11)
    loss, _ = model(b, sampling_seed=5)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, torch.get_rng_state()


def assert_same_step(reference, other) -> None:
    (loss_a, grads_a, rng_a), (loss_b, grads_b, rng_b) = reference, other
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name  # bitwise: tolerance 0
    assert torch.equal(rng_a, rng_b)  # the recompute forks the generator: the step leaves it where it would


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Bitwise comparisons on one intra-op thread: with several, the CPU's parallel accumulation of the
    embedding gradient (BERT-NCE's sampled rows) sums in a varying order between any two runs, with
    checkpointing or without (seen in a full-suite run on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_gradients_equal_without_checkpointing_bitwise(arch, objective):
    """Dropout on, training mode, a padded row on the varlen path; `all` and every 2nd layer."""
    reference_model = make(arch, objective, "none", attention="varlen")
    once = layer_calls(reference_model)  # CAPT passes two views, COCO-LM's generator is a stack too
    b = batch(reference_model)
    reference = step(reference_model, b)
    for setting, period in (("all", 1), ("2", 2)):
        model = make(arch, objective, setting, attention="varlen")
        calls = layer_calls(model)
        assert_same_step(reference, step(model, b))
        # the checkpointed layers (of every stack) really recomputed: their forward ran again in backward
        assert calls.keys() == once.keys() and all(once.values())
        for name, count in calls.items():
            index = int(name.rsplit(".", 1)[1])
            assert count == once[name] * (2 if is_checkpointed(index, period) else 1), (name, count, once[name])


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
@pytest.mark.parametrize("padded", [False, True])
def test_dense_and_masked_paths_equal(arch, padded):
    """`model.attention=auto` on the CPU: full rows take the dense path, a padded row the masked one."""
    reference_model = make(arch, "taco", "none")
    b = batch(reference_model, padded)
    assert_same_step(step(reference_model, b), step(make(arch, "taco", "all"), b))


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_compiled_layers_checkpoint_and_equal_without(arch):
    """`model.compile=true`: the compiled layers run inside the checkpoint (no graph break, no eager
    fallback) and give the compiled run's gradients without checkpointing, bit for bit, dropout on."""
    torch._dynamo.reset()
    reference_model = make(arch, "mlm", "none", compile_layers=True)
    b = batch(reference_model, padded=False)
    reference = step(reference_model, b)
    counters.clear()
    assert_same_step(reference, step(make(arch, "mlm", "all", compile_layers=True), b))
    assert not counters["graph_break"]


def test_period_rule():
    assert [checkpoint_period(v, 24) for v in ("none", "all", "1", 3, "24", "ALL")] == [0, 1, 1, 3, 24, 1]
    assert [i for i in range(7) if is_checkpointed(i, 3)] == [0, 3, 6]
    assert not any(is_checkpointed(i, 0) for i in range(7))


@pytest.mark.parametrize("value, message", [
    ("3", r"model.activation_checkpointing='3': k is above the model's 2 layers"),
    ("0", r"model.activation_checkpointing='0': k must be >= 1"),
    ("-2", r"model.activation_checkpointing='-2': k must be >= 1"),
    ("every", r"model.activation_checkpointing='every': must be 'none', 'all' or a positive integer k"),
])
def test_bad_values_are_refused_naming_the_field(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-mlm", [f"model.activation_checkpointing={value}"])


def test_k_is_checked_against_the_overridden_depth():
    assert load_config("tiny-mlm", ["model.num_layers=6", "model.activation_checkpointing=6"]).model.activation_checkpointing == "6"
    with pytest.raises(ConfigError, match=r"above the model's 3 layers"):
        load_config("tiny-mlm", ["model.arch=modernbert", "model.activation_checkpointing=4"])


def test_bad_value_exits_2_before_compute(tiny_shards_dir, tmp_path, capsys):
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path, "model.activation_checkpointing=9") == 2
    assert "model.activation_checkpointing='9'" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("arch, engine", [("bert", "zero3"), ("modernbert", "zero2")])
def test_deepspeed_run_logs_the_same_metrics(arch, engine, tiny_shards_dir, tmp_path, caplog):
    """A 3-step run through the DeepSpeed engine (ZeRO-3 gathers the partitioned weights again for the
    recompute) with dropout on: every logged metric of every step equals the run without checkpointing. The
    run says at start-up that its layers are checkpointed (issue 58: nothing said so)."""
    runs, said = {}, {}
    for setting in ("none", "all"):
        out = tmp_path / setting
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pipeline.train"):
            assert run_inprocess("tiny-mlm", tiny_shards_dir, out, f"model.arch={arch}", f"deepspeed.config={engine}",
                                 "train.total_steps=3", "train.checkpoint_every=3",
                                 f"model.activation_checkpointing={setting}") == 0
        runs[setting] = metric_rows(out)
        said[setting] = [r.getMessage() for r in caplog.records if "activation checkpointing" in r.getMessage()]
    assert sorted(runs["none"]) == [1, 2, 3]
    assert runs["all"] == runs["none"]  # every metric but timing and memory (`metric_rows` drops those)
    assert said["none"] == [] and len(said["all"]) == 1
    assert said["all"][0].startswith("activation checkpointing on (model.activation_checkpointing): ")
    layers = 2 if arch == "bert" else 3  # the tiny sizes' depths
    assert f"bert.encoder: {layers} of {layers} layers (every layer) recompute their activations" in said["all"][0]


def test_the_start_up_line_names_each_stack_and_its_layers():
    model = make("bert", "cocolm", "2")  # 3 encoder layers and a 2-layer generator, every 2nd checkpointed
    line = describe(model)
    assert ": 2 of 3 layers (one in 2: layers 0, 2, 4, ...)" in line
    assert ": 1 of 2 layers (one in 2: layers 0, 2, 4, ...)" in line  # the generator
    assert describe(make("bert", "mlm", "none")) == ""


def test_a_warm_start_is_checked_against_its_own_depth(tmp_path):
    """With `model.init_from` the depth is the base model's config.json's, not the size preset's (tiny: 2)."""
    from transformers import BertConfig

    BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=128,
               max_position_embeddings=LENGTH).save_pretrained(tmp_path)
    fine = load_config("tiny-mlm", [f"model.init_from={tmp_path}", "model.activation_checkpointing=4"])
    assert fine.model.encoder_config(VOCAB, LENGTH, SPECIAL).num_layers == 4
    deep = load_config("tiny-mlm", [f"model.init_from={tmp_path}", "model.activation_checkpointing=5"])
    with pytest.raises(ConfigError, match=r"model.activation_checkpointing='5': k is above the model's 4 layers"):
        deep.model.encoder_config(VOCAB, LENGTH, SPECIAL)
