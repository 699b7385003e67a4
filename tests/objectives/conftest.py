"""Tiny hand-built batches that follow the collator's batch contract (see the common brief /
`pipeline.objectives.base.VIEWS`), so objective tests depend on nothing but the contract.

The corruption here is deliberately simple (it is test data, not the pipeline's masking): a fixed
fraction of non-special positions is selected, spans are contiguous runs of 1-4 tokens, the crop
is a contiguous 90% slice re-wrapped in CLS..SEP.
"""
from __future__ import annotations

import pytest
import torch

from pipeline.data.corruption import document_ids
from pipeline.model.encoder import build_encoder_config
from pipeline.pretrain.pretrainer import PretrainModel

SPECIAL = {"pad": 0, "cls": 1, "sep": 2, "mask": 3, "unk": 4}
VOCAB = 97  # distinct from every hidden/FFN size of the tiny preset, so vocab-sized matmuls are recognisable
FIRST_WORD_ID = 5


def make_batch(batch_size: int = 4, seq_len: int = 24, seed: int = 0, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pad, cls, sep, mask = SPECIAL["pad"], SPECIAL["cls"], SPECIAL["sep"], SPECIAL["mask"]
    input_ids = torch.full((batch_size, seq_len), pad, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    crop_ids = torch.full_like(input_ids, pad)
    crop_mask = torch.zeros_like(attention_mask)
    shuffled = torch.full_like(input_ids, pad)
    masked_ids, mlm_labels = input_ids.clone(), torch.full_like(input_ids, -100)
    span_ids, span_labels = input_ids.clone(), torch.full_like(input_ids, -100)
    span_index = torch.full_like(input_ids, -1)
    for b in range(batch_size):
        n = int(torch.randint(seq_len // 2, seq_len - 1, (1,), generator=g))  # real tokens between CLS and SEP
        tokens = torch.randint(FIRST_WORD_ID, vocab, (n,), generator=g)
        input_ids[b, 0], input_ids[b, 1 : n + 1], input_ids[b, n + 1] = cls, tokens, sep
        attention_mask[b, : n + 2] = 1
        # masked view: ~15% (>= 1) of the real tokens, 80/10/10
        k = max(1, round(0.15 * n))
        pos = torch.randperm(n, generator=g)[:k] + 1
        masked_ids[b] = input_ids[b]
        mlm_labels[b, pos] = input_ids[b, pos]
        for p in pos.tolist():
            r = float(torch.rand((), generator=g))
            masked_ids[b, p] = mask if r < 0.8 else (int(torch.randint(FIRST_WORD_ID, vocab, (1,), generator=g)) if r < 0.9 else masked_ids[b, p])
        # span view: contiguous runs of 1..4 tokens until >= 15% covered
        span_ids[b] = input_ids[b]
        covered, number = 0, 0
        while covered < k:
            length = int(torch.randint(1, 5, (1,), generator=g))
            start = int(torch.randint(1, n + 1, (1,), generator=g))
            cols = list(range(start, min(start + length, n + 1)))
            if any(span_index[b, c] >= 0 for c in cols):
                continue
            for c in cols:
                span_index[b, c], span_labels[b, c], span_ids[b, c] = number, input_ids[b, c], mask
            covered += len(cols)
            number += 1
        # crop view: contiguous 90% of the real tokens, re-wrapped
        m = max(1, int(0.9 * n))
        s = int(torch.randint(0, n - m + 1, (1,), generator=g))
        crop_ids[b, 0], crop_ids[b, 1 : m + 1], crop_ids[b, m + 1] = cls, tokens[s : s + m], sep
        crop_mask[b, : m + 2] = 1
        # shuffled view: shuffle inside windows of 3
        perm = torch.cat([torch.randperm(min(3, n - i), generator=g) + i for i in range(0, n, 3)])
        shuffled[b] = input_ids[b]
        shuffled[b, 1 : n + 1] = tokens[perm]
    special_mask = (input_ids == cls) | (input_ids == sep) | (attention_mask == 0)
    word_starts = (torch.rand(batch_size, seq_len, generator=g) < 0.7) & ~special_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "special_mask": special_mask,
        "word_starts": word_starts,
        "sample_index": torch.arange(batch_size) + seed * batch_size,
        "document_ids": torch.from_numpy(document_ids(input_ids.numpy(), special_mask.numpy(), sep)),
        "masked_ids": masked_ids,
        "mlm_labels": mlm_labels,
        "span_masked_ids": span_ids,
        "span_labels": span_labels,
        "span_index": span_index,
        "crop_ids": crop_ids,
        "crop_attention_mask": crop_mask,
        "shuffled_ids": shuffled,
    }


def tiny_model(objectives: dict[str, float], options: dict | None = None, seed: int = 0, **cfg) -> PretrainModel:
    torch.manual_seed(seed)
    config = build_encoder_config("tiny", vocab_size=VOCAB, max_position=64, **cfg)
    return PretrainModel(config, objectives, SPECIAL, objective_options=options or {}, seed=seed, kernels="torch")


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    return make_batch()
