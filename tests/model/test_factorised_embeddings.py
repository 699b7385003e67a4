"""Factorised embeddings (`model.embedding_size` E != H, ELECTRA-Small's 128 under a hidden 256): the encoder and
its tied MLM head compute what `transformers.ElectraForMaskedLM` computes on the same weights (forward and
gradients) and what a loop written from the equations computes; E = H adds no parameter and changes no value; the
parameter count follows the formula; bad values are refused in one line naming the field."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.config.checks import ConfigError
from pipeline.export.electra_adapter import electra_hf_config
from pipeline.model.arch import build_encoder_and_head, init_weights
from pipeline.model.config import ModelConfig
from pipeline.model.encoder import EncoderConfig, split_qkv
from pipeline.train.metrics import mlm_step_flops

V, E, H, L, P = 53, 12, 32, 2, 24


def _config(embedding_size=E, **kw) -> EncoderConfig:
    return EncoderConfig(vocab_size=V, hidden_size=H, num_layers=L, num_heads=2, ffn_size=48, max_position=P,
                         dropout=0.0, attention_dropout=0.0, embedding_size=embedding_size, **kw)


def _model(embedding_size=E, seed=0):
    torch.manual_seed(seed)
    cfg = _config(embedding_size)
    encoder, head = build_encoder_and_head(cfg)
    init_weights(encoder, cfg)
    init_weights(head, cfg)
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a misplaced one shows
        for name, p in list(encoder.named_parameters()) + list(head.named_parameters()):
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return cfg, encoder.eval(), head.eval()


def _hf(cfg: EncoderConfig, encoder, head):
    from transformers import ElectraForMaskedLM

    config = electra_hf_config(cfg, {"pad": 0})
    hf = ElectraForMaskedLM(config).eval()
    ours = {"electra." + k: v for k, v in split_qkv(encoder.state_dict()).items()}
    ours.update({"generator_predictions." + k: v for k, v in head.predictions.transform.state_dict().items()})
    ours["generator_lm_head.bias"] = head.predictions.decoder.bias.detach()
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    assert not unexpected and set(missing) <= {"generator_lm_head.weight", "electra.embeddings.position_ids"}
    hf.tie_weights()
    return hf


def _inputs():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (3, 17), generator=gen)
    mask = (torch.arange(17)[None] < torch.tensor([17, 11, 5])[:, None]).long()
    return ids, mask


def test_shapes_and_no_new_parameters_when_e_equals_h():
    cfg, encoder, head = _model()
    assert encoder.embeddings.word_embeddings.weight.shape == (V, E)
    assert encoder.embeddings.LayerNorm.weight.shape == (E,)
    assert encoder.embeddings_project.weight.shape == (H, E)
    assert head.predictions.transform.dense.weight.shape == (E, H)
    assert head.predictions.decoder.weight is encoder.embeddings.word_embeddings.weight  # tied at E
    _, plain, plain_head = _model(None)
    _, same, same_head = _model(H)  # E = H explicitly: the unfactorised model, bitwise
    for a, b in ((plain, same), (plain_head, same_head)):
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "embeddings_project.weight" not in plain.state_dict()


def test_parameter_count_formula():
    cfg, encoder, head = _model()
    f = cfg.ffn_size
    layer = (3 * H * H + 3 * H) + (H * H + H) + 2 * H + (H * f + f) + (f * H + H) + 2 * H
    expected = (V + P + 2) * E + 2 * E + (E * H + H) + L * layer  # embeddings + LayerNorm + projection + layers
    assert sum(p.numel() for p in encoder.parameters()) == expected
    head_own = sum(p.numel() for n, p in head.named_parameters() if n != "predictions.decoder.weight")
    assert head_own == (H * E + E) + 2 * E + V  # transform H -> E, LayerNorm at E, output bias
    # the FLOP formula's head terms: 2 N h E + 2 N E V (E = h: the unfactorised formula)
    assert mlm_step_flops(1, 1, H, f, 0, 5, V, E) == 3.0 * (2 * 5 * H * E + 2 * 5 * E * V)
    assert mlm_step_flops(1, 1, H, f, 0, 5, V) == mlm_step_flops(1, 1, H, f, 0, 5, V, H)


def test_forward_and_gradients_equal_transformers_electra_for_masked_lm():
    cfg, encoder, head = _model()
    hf = _hf(cfg, encoder, head)
    ids, mask = _inputs()
    labels = ids.masked_fill(mask == 0, -100)
    out = encoder(ids, mask)
    logits = head(out.last_hidden)
    loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    hf_out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    torch.testing.assert_close(logits[real], hf_out.logits[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, hf_out.loss, rtol=0, atol=1e-6)
    loss.backward()
    hf_out.loss.backward()
    pairs = {"embeddings.word_embeddings.weight": hf.electra.embeddings.word_embeddings.weight,
             "embeddings.LayerNorm.weight": hf.electra.embeddings.LayerNorm.weight,
             "embeddings_project.weight": hf.electra.embeddings_project.weight,
             "embeddings_project.bias": hf.electra.embeddings_project.bias}
    for name, theirs in pairs.items():
        torch.testing.assert_close(dict(encoder.named_parameters())[name].grad, theirs.grad, rtol=0, atol=1e-6,
                                   msg=name)
    torch.testing.assert_close(head.predictions.transform.dense.weight.grad,
                               hf.generator_predictions.dense.weight.grad, rtol=0, atol=1e-6)


def test_forward_equals_a_loop_over_the_equations():
    """e = W_p LN_E(x_word + x_pos + x_type) + b_p feeds the layers; the head is LN_E(gelu(W_t h + b_t)) then the
    tied W_word^T with the output bias (written here without the model's modules)."""
    cfg, encoder, head = _model()
    ids, _ = _inputs()
    emb = encoder.embeddings
    p = {k: v.detach() for k, v in encoder.state_dict().items()}
    with torch.no_grad():
        x = p["embeddings.word_embeddings.weight"][ids] + p["embeddings.position_embeddings.weight"][:ids.shape[1]] \
            + p["embeddings.token_type_embeddings.weight"][0]
        x = F.layer_norm(x, (E,), p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"], emb.LayerNorm.eps)
        e = x @ p["embeddings_project.weight"].T + p["embeddings_project.bias"]
        out = encoder(ids)
        torch.testing.assert_close(out.embedding_output, e, rtol=0, atol=1e-6)
        torch.testing.assert_close(out.last_hidden, encoder.encoder(e, None), rtol=0, atol=0)
        t = head.predictions.transform
        z = F.layer_norm(F.gelu(out.last_hidden @ t.dense.weight.T + t.dense.bias), (E,), t.LayerNorm.weight,
                         t.LayerNorm.bias, t.LayerNorm.eps)
        expected = z @ p["embeddings.word_embeddings.weight"].T + head.predictions.decoder.bias
        torch.testing.assert_close(head(out.last_hidden), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("value", [0, -128, 1.5, "128", True])
def test_bad_embedding_size_is_refused_in_one_line(value):
    with pytest.raises(ConfigError, match=r"^model\.embedding_size=.*must be a positive integer") as err:
        ModelConfig(embedding_size=value).check()
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^model\.embedding_size="):
        _config(value)


def test_embedding_size_refused_for_modernbert_and_warm_starts():
    with pytest.raises(ConfigError, match=r"^model\.embedding_size=16: only for model\.arch=bert"):
        ModelConfig(arch="modernbert", embedding_size=16).check()
    with pytest.raises(ConfigError, match=r"^model\.embedding_size=16: a warm start"):
        ModelConfig(embedding_size=16, init_from="/some/bert").check()
    ModelConfig(embedding_size=128).check()  # above the hidden size is fine too
    encoder = ModelConfig(size="tiny", embedding_size=16).encoder_config(V, P, {"pad": 0})
    assert (encoder.embedding_width, encoder.hidden_size, encoder.factorised) == (16, 64, True)
