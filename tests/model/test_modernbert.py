"""The ModernBERT-style encoder (`pipeline.model.modernbert`) against Hugging Face's `ModernBertModel`, its
sliding window and rotary bases, initialisation, config checks and FLOP count."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pipeline.config.checks import ConfigError
from pipeline.model.attention import varlen_layout
from pipeline.pretrain.build import build_pretrain_model
from pipeline.model.config import ModelConfig
from pipeline.model.modernbert import ModernBertConfig, ModernBertEncoder, ModernBertLayer, window_pairs
from tests.model.rounding import gradient_bound

SPECIAL = {"pad": 0, "cls": 1, "sep": 2, "mask": 3, "unk": 4}
#: Not a preset: 5 layers, global every 2nd, an 8-token window, unusual rotary bases.
CFG = ModernBertConfig(vocab_size=90, hidden_size=32, num_layers=5, num_heads=4, ffn_size=40, max_position=64,
                       local_attention=8, global_attn_every_n_layers=2, global_rope_theta=500.0, local_rope_theta=50.0)


def _hf_model(cfg: ModernBertConfig, ours: torch.nn.Module):
    from transformers import ModernBertForMaskedLM

    from pipeline.export.modernbert_adapter import modernbert_hf_config
    from pipeline.model.hf_names import to_modernbert_hf

    hf = ModernBertForMaskedLM(modernbert_hf_config(cfg, SPECIAL)).eval()
    missing, unexpected = hf.load_state_dict(to_modernbert_hf(ours.state_dict()), strict=False)
    assert missing == ["decoder.weight"] and not unexpected  # the tied weight only
    return hf


def _perturbed_model(cfg: ModernBertConfig):
    torch.manual_seed(0)
    model = build_pretrain_model(cfg, {"mlm": 1.0}, SPECIAL, {}).eval()
    with torch.no_grad():  # norms and biases off their init constants; sharp attention, so positions matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("Wqkv.weight"):
                p.mul_(12.0)
    return model


def _padded_batch(vocab: int):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([48, 30, 7, 48])
    mask = (torch.arange(48)[None] < lengths[:, None]).long()
    return torch.randint(5, vocab, (4, 48), generator=gen) * mask, mask, lengths


@pytest.mark.parametrize("biases", [False, True])
def test_logits_equal_hugging_face_modernbert(biases):
    """Every attention path (masked reference, unpadded varlen, dense) gives HF's MLM logits; with HF's
    optional biases switched on too (norm, attention, MLP, head), so each flag is mapped."""
    flags = dict(norm_bias=biases, attention_bias=biases, mlp_bias=biases, classifier_bias=biases)
    cfg = dataclasses.replace(CFG, **flags)
    ours = _perturbed_model(cfg)
    assert any(n.endswith("Wqkv.bias") for n, _ in ours.named_parameters()) == biases
    hf = _hf_model(cfg, ours)
    ids, mask, lengths = _padded_batch(cfg.vocab_size)
    with torch.no_grad():
        reference = hf(input_ids=ids, attention_mask=mask).logits
        for mode, seqlens in (("masked", None), ("varlen", lengths), ("auto", lengths)):
            ours.bert.encoder.attention = mode
            logits = ours.cls(ours.bert(ids, mask, seqlens=seqlens).last_hidden)
            torch.testing.assert_close(logits[mask.bool()], reference[mask.bool()], rtol=0, atol=1e-5, msg=mode)
        full = ids[[0, 3]]
        torch.testing.assert_close(ours.cls(ours.bert(full).last_hidden), hf(input_ids=full).logits, rtol=0, atol=1e-5)


def test_window_and_rotary_bases_change_the_output():
    """The comparison above is sensitive to both: a wider window or swapped bases give other states."""
    model = _perturbed_model(CFG)
    ids = _padded_batch(CFG.vocab_size)[0][[0]]
    reference = model.bert(ids).last_hidden
    for change in (dict(local_attention=64), dict(global_rope_theta=50.0, local_rope_theta=500.0)):
        other = ModernBertEncoder(dataclasses.replace(CFG, **change)).eval()
        other.load_state_dict(model.bert.state_dict())
        assert (other(ids).last_hidden - reference).abs().max() > 0.05, change  # >> the 1e-5 tolerance above


@pytest.mark.parametrize("path", ["masked", "varlen"])
def test_local_layer_sees_only_its_window(path):
    """d out_i / d x_j = 0 exactly when |i - j| > local_attention / 2 (and across sequences), on both paths."""
    layer = ModernBertLayer(CFG, index=1).eval()
    assert not layer.is_global and layer.attn.window == 4
    length, query = 24, 10
    x = torch.randn(2, length, CFG.hidden_size, requires_grad=True)
    positions = torch.arange(length)
    from pipeline.model.attention import window_bias
    from pipeline.model.modernbert import rotary_tables

    cos, sin = rotary_tables(positions[None], CFG.head_dim, CFG.local_rope_theta, x.dtype)
    if path == "masked":
        out = layer(x, window_bias(length, CFG.window, x.dtype, x.device)[None, None], cos, sin)
    else:
        layout = varlen_layout([length, length], length, x.device)
        flat_cos, flat_sin = cos.expand(2, -1, -1).reshape(-1, CFG.head_dim), sin.expand(2, -1, -1).reshape(-1, CFG.head_dim)
        out = layer(x.reshape(-1, CFG.hidden_size), layout, flat_cos, flat_sin).view(2, length, -1)
    out[0, query].sum().backward()
    touched = x.grad[0].abs().sum(-1) > 0
    assert touched.tolist() == [abs(j - query) <= 4 for j in range(length)]
    assert x.grad[1].abs().sum() == 0


def test_initialisation_and_no_biases():
    cfg = ModernBertConfig(vocab_size=500, hidden_size=256, num_layers=8, num_heads=4, ffn_size=512)
    model = build_pretrain_model(cfg, {"mlm": 1.0}, SPECIAL, {})
    names = [n for n, _ in model.bert.named_parameters()]
    assert not any(n.endswith(".bias") for n in names)  # bias-free layers and norms
    assert "encoder.layers.0.attn_norm.weight" not in names  # layer 0: the embedding norm serves
    wqkv, wo = model.bert.encoder.layers[3].attn.Wqkv.weight, model.bert.encoder.layers[3].mlp.Wo.weight
    assert wqkv.std().item() == pytest.approx(0.02 * 0.88, rel=0.05)  # N(0, 0.02) cut at 2 sigma: std 0.88 sigma
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(16) * 0.88, rel=0.05)  # output layers: sigma / sqrt(2L)
    assert wqkv.abs().max() <= 2 * 0.02 + 1e-7
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.tok_embeddings.weight


@pytest.mark.parametrize("fields, message", [
    (dict(local_attention=16), r"model.local_attention=16: only for model.arch=modernbert"),
    (dict(arch="modernbert", size="taco-small"), r"model.size='taco-small': unknown for model.arch=modernbert"),
    (dict(arch="modernbert", local_attention=15), r"model.local_attention=15: must be even"),
    (dict(arch="modernbert", hidden_size=66, num_heads=6), r"model.hidden_size / model.num_heads = 11 is odd; rotary"),
    (dict(arch="modernbrt"), r"model.arch='modernbrt'"),
    (dict(arch="modernbert", layernorm="apex"), r"model.layernorm=apex: .*use model.layernorm=torch"),
])
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**fields).check()


def test_presets_and_overrides_shape_the_encoder():
    cfg = ModelConfig(arch="modernbert", size="base", global_attn_every_n_layers=4, max_position=8192)
    cfg.check()
    enc = cfg.encoder_config(50368, 8192, SPECIAL)
    assert isinstance(enc, ModernBertConfig)
    assert (enc.num_layers, enc.hidden_size, enc.num_heads, enc.ffn_size) == (22, 768, 12, 1152)
    assert (enc.local_attention, enc.global_attn_every_n_layers, enc.max_position) == (128, 4, 8192)
    assert [enc.is_global(i) for i in range(5)] == [True, False, False, False, True]
    large = ModelConfig(arch="modernbert", size="large").shape()
    assert (large["num_layers"], large["hidden_size"], large["ffn_size"]) == (28, 1024, 2624)
    assert ModelConfig(arch="modernbert", size="large-24").shape()["num_layers"] == 24


def test_flops_of_a_pass_count_geglu_and_the_window():
    assert [window_pairs(s, 2) for s in (1, 2, 3, 10)] == [1, 4, 9, 10 * 5 - 6]
    assert window_pairs(10, 2) == sum(1 for i in range(10) for j in range(10) if abs(i - j) <= 2)
    from pipeline.train.metrics import FlopCounter

    model = _perturbed_model(CFG)
    counter = FlopCounter(model)
    ids, mask, lengths = _padded_batch(CFG.vocab_size)
    model.bert.encoder.attention = "varlen"
    with torch.no_grad():
        model.bert(ids, mask, seqlens=lengths)
    h, f = CFG.hidden_size, CFG.ffn_size
    tokens = int(lengths.sum())
    expected = sum(2 * tokens * (4 * h * h + 3 * h * f) + 4 * h * sum(
        s * s if CFG.is_global(layer) else window_pairs(s, 4) for s in lengths.tolist()) for layer in range(5))
    assert counter.pop() == pytest.approx(expected)  # no-grad pass: forward only


def test_compiled_layers_equal_eager_values_and_gradients():
    """`model.compile=true` on ModernBERT (COCO-LM: main stack and generator): values and gradients as eager."""
    cfg = dataclasses.replace(CFG, num_layers=3, max_position=48)
    models = [build_pretrain_model(cfg, {"cocolm": 1.0}, SPECIAL, {"cocolm": {"generator_layers": 1}}, seed=3,
                                   kernels="torch", compile_layers=flag) for flag in (False, True, False)]
    assert models[1].bert.encoder._compiled is not None and models[1].objectives["cocolm"].generator._compiled is not None
    models[2].double()  # the float64 reference: the eager result's own rounding (tests/model/rounding.py)
    ids, mask, lengths = _padded_batch(cfg.vocab_size)
    full = ids[[0, 3]]
    grads = []
    for m in models:
        out = m.cls(m.bert(full).last_hidden).square().mean()
        out.backward()
        grads.append((out.detach(), m.bert.encoder.layers[1].attn.Wqkv.weight.grad.clone()))
    (loss_e, grad_e), (loss_c, grad_c), (_, grad_64) = grads
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert float((grad_c - grad_e).abs().max()) <= gradient_bound(grad_e, grad_64, full.numel())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_window_paths_match_the_fp32_masked_reference(dtype):
    """CUDA, half precision: local layers run the flash kernel with a window (dense rows and unpadded rows);
    the result matches the fp32 masked reference within half-precision error."""
    model = _perturbed_model(CFG).cuda()
    ids, mask, lengths = (t.cuda() for t in _padded_batch(CFG.vocab_size))
    with torch.no_grad():
        model.bert.encoder.attention = "masked"
        reference = model.bert(ids, mask).last_hidden.float()
        reference_full = model.bert(ids[[0, 3]]).last_hidden.float()
        model.to(dtype)
        model.bert.encoder.attention = "auto"
        varlen = model.bert(ids, mask, seqlens=lengths.cpu()).last_hidden.float()
        dense = model.bert(ids[[0, 3]]).last_hidden.float()
    real = mask.bool()
    torch.testing.assert_close(varlen[real], reference[real], rtol=0, atol=0.1)
    torch.testing.assert_close(dense, reference_full, rtol=0, atol=0.1)
    assert (varlen[real] - reference[real]).abs().mean() < 0.02
