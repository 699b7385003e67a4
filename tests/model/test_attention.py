"""The encoder's attention paths (`pipeline.model.attention`) against the masked reference path:
no mask when nothing is padded (so SDPA may pick flash), unpadded variable-length attention for
padded views, values and gradients equal per dtype, FLOPs of what really runs, and no host read of
device data to decide."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.attention import plan_attention, varlen_layout
from pipeline.model.encoder import BertEncoder, build_encoder_config, configure_layer_stacks, init_bert_weights
from pipeline.train.metrics import FlopCounter, layer_work_flops

VOCAB, LENGTH = 53, 20
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}


def encoder(attention: str, dtype=torch.float32, seed: int = 0) -> BertEncoder:
    torch.manual_seed(seed)
    cfg = build_encoder_config("tiny", vocab_size=VOCAB, max_position=LENGTH, dropout=0.0, attention_dropout=0.0)
    model = BertEncoder(cfg)
    init_bert_weights(model, 0.2)  # larger than BERT's 0.02 so that attention weights are far from uniform
    configure_layer_stacks(model, attention)
    return model.to(dtype)


def batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (len(lengths), LENGTH), generator=g)
    seqlens = torch.tensor(lengths)
    mask = (torch.arange(LENGTH)[None, :] < seqlens[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask, seqlens


def run(model: BertEncoder, ids, mask, seqlens, probe: torch.Tensor):
    """Last hidden state and the parameter gradients of a loss that reads only real tokens."""
    model.zero_grad()
    out = model(ids, mask, seqlens=seqlens).last_hidden
    keep = mask.bool()
    loss = (out.float() * probe).sum(-1)[keep].square().mean()
    loss.backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["varlen", "dense"])
def test_fast_paths_equal_the_masked_reference(dtype, path):
    lengths = [LENGTH, 7, 13, LENGTH] if path == "varlen" else [LENGTH] * 4
    ids, mask, seqlens = batch(lengths)
    probe = torch.randn(64, generator=torch.Generator().manual_seed(3))
    ref_out, ref_grads = run(encoder("masked", dtype), ids, mask, seqlens, probe)
    fast = encoder(path if path == "varlen" else "auto", dtype)
    out, grads = run(fast, ids, mask, seqlens, probe)
    keep = mask.bool()
    torch.testing.assert_close(out[keep].float(), ref_out[keep].float(), **TOLERANCE[dtype])
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        scale = ref_grads[name].float().abs().max().clamp(min=1e-3)
        torch.testing.assert_close(g.float() / scale, ref_grads[name].float() / scale, **TOLERANCE[dtype], msg=name)
    if path == "varlen":
        assert not out[~keep].any()  # padding rows hold zeros: nothing was computed there
        assert fast.encoder.last_work == (sum(lengths), sum(s * s for s in lengths))
    else:
        assert fast.encoder.last_work == (4 * LENGTH, 4 * LENGTH * LENGTH)


def test_no_mask_reaches_sdpa_when_the_collator_says_nothing_is_padded(monkeypatch):
    masks = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids, mask, seqlens = batch([LENGTH] * 3)
    model = encoder("auto")
    model(ids, mask, seqlens=seqlens)
    assert len(masks) == 2 and all(m is None for m in masks)  # one call per layer, none masked
    masks.clear()
    model(ids, mask)  # no host-side lengths: nobody vouched for the layout -> the masked reference
    assert len(masks) == 2 and all(m is not None and m.shape == (3, 1, 1, LENGTH) for m in masks)
    masks.clear()
    encoder("masked")(ids, mask, seqlens=seqlens)  # model.attention=masked: always the reference
    assert all(m is not None for m in masks)


def test_the_plan_never_reads_device_data():
    """The decision uses host lengths and shapes only: a mask on the `meta` device (no data at all)
    is enough to plan every path."""
    x = torch.zeros(3, LENGTH, 8)
    meta_mask = torch.ones(3, LENGTH, dtype=torch.long, device="meta")
    full, padded = torch.full((3,), LENGTH), torch.tensor([LENGTH, 4, 9])
    assert plan_attention(x, meta_mask, full, "auto", 8).kind == "dense"
    assert plan_attention(x, meta_mask, padded, "varlen", 8).kind == "varlen"
    assert plan_attention(x, meta_mask, padded, "auto", 8).kind == "masked"  # CPU: no varlen kernel
    assert plan_attention(x, meta_mask, None, "auto", 8).kind == "masked"
    with pytest.raises(ValueError, match="do not describe a \\[3, 20\\] batch"):
        plan_attention(x, meta_mask, torch.tensor([LENGTH + 1, 1, 1]), "varlen", 8)
    with pytest.raises(ValueError, match="model.attention='flash'"):
        plan_attention(x, meta_mask, full, "flash", 8)


def test_varlen_layout_is_built_from_host_lengths():
    layout = varlen_layout([3, 0, 5], 6, torch.device("cpu"))
    assert layout.indices.tolist() == [0, 1, 2, 12, 13, 14, 15, 16]
    assert layout.cu_seqlens.tolist() == [0, 3, 3, 8] and layout.cu_seqlens.dtype == torch.int32
    assert (layout.max_seqlen, layout.tokens, layout.batch, layout.length) == (5, 8, 3, 6)


def test_flops_count_the_tokens_an_unpadded_pass_processes():
    lengths = [LENGTH, 6, 11]
    ids, mask, seqlens = batch(lengths)
    flops = {}
    for mode in ("masked", "varlen"):
        model = encoder(mode)
        counter = FlopCounter(model)
        with torch.no_grad():
            model(ids, mask, seqlens=seqlens)
        flops[mode] = counter.pop()
        counter.remove()
    assert flops["masked"] == 2 * layer_work_flops(3 * LENGTH, 3 * LENGTH**2, 64, 128)
    assert flops["varlen"] == 2 * layer_work_flops(sum(lengths), sum(s * s for s in lengths), 64, 128)


@pytest.mark.gpu
def test_flash_varlen_on_cuda_equals_the_masked_reference():
    """bf16 on the GPU: the flash varlen kernel (not the re-padded fallback) against masked SDPA;
    then with attention dropout, which the kernel applies itself, it still trains."""
    ids, mask, seqlens = batch([LENGTH, 7, 13, 3])
    probe = torch.randn(64, generator=torch.Generator().manual_seed(3)).cuda()
    models = [encoder(mode, torch.bfloat16).cuda() for mode in ("masked", "auto")]
    args = (ids.cuda(), mask.cuda(), seqlens)
    ref_out, ref_grads = run(models[0], *args, probe)
    out, grads = run(models[1], *args, probe)
    assert models[1].encoder.last_work[0] == int(seqlens.sum())  # the unpadded path ran
    keep = mask.cuda().bool()
    torch.testing.assert_close(out[keep].float(), ref_out[keep].float(), **TOLERANCE[torch.bfloat16])
    for name, g in grads.items():
        scale = ref_grads[name].float().abs().max().clamp(min=1e-3)
        torch.testing.assert_close(g.float() / scale, ref_grads[name].float() / scale, **TOLERANCE[torch.bfloat16])
    for layer in models[1].encoder.layer:
        layer.attention.self.attention_dropout = 0.1
    _, grads = run(models[1].train(), *args, probe)
    assert all(torch.isfinite(g).all() for g in grads.values()) and any(g.abs().sum() > 0 for g in grads.values())
