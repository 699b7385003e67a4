"""TACO on FULL-packed rows: the collator's `document_ids` keep every positive inside its anchor's
document, and the negatives are the tokens of the *other* documents (other rows and the other
documents of the anchor's own row), uniformly — checked anchor by anchor against loops."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.batch import content_tokens
from pipeline.data.corruption import CorruptionCollator, document_ids
from pipeline.kernels.functional import token_contrastive_loss
from pipeline.objectives.taco import sample_taco_indices
from pipeline.seeding import sampling_seed
from tests.objectives.conftest import SPECIAL, VOCAB, make_batch, tiny_model

CLS, SEP, PAD = SPECIAL["cls"], SPECIAL["sep"], SPECIAL["pad"]


def packed_batch() -> dict[str, torch.Tensor]:
    """Three FULL-packed rows of 16: row 0 holds documents of 5, 1 and 6 tokens; row 1 one document
    and padding; row 2 two documents, the second one possibly cut by the row end."""
    rows = [
        [CLS, *range(10, 15), SEP, 20, SEP, *range(30, 36), SEP],
        [CLS, *range(40, 48), SEP, *[PAD] * 6],
        [CLS, *range(50, 53), SEP, *range(60, 70), SEP],
    ]
    ids = np.array(rows, dtype=np.int64)
    collator = CorruptionCollator(("original",), SPECIAL, VOCAB, seed=0)
    return collator.collate(ids, np.ones_like(ids), np.arange(3))


def test_collator_numbers_the_documents_of_each_row():
    docs = packed_batch()["document_ids"]
    assert docs[0].tolist() == [-1, 0, 0, 0, 0, 0, -1, 1, -1, 2, 2, 2, 2, 2, 2, -1]
    assert docs[1].tolist() == [-1] + [0] * 8 + [-1] * 7
    assert docs[2].tolist() == [-1, 0, 0, 0, -1] + [1] * 10 + [-1]


def unit_of(batch, flat: int) -> tuple[int, int]:
    length = batch["input_ids"].shape[1]
    return flat // length, int(batch["document_ids"].reshape(-1)[flat])


@pytest.mark.parametrize("negative_unit", ["document", "row"])
def test_every_taco_positive_and_negative_respects_the_documents(negative_unit):
    batch = packed_batch()
    eligible = content_tokens(batch)
    length = eligible.shape[1]
    k = 3000
    anchors, positives, negatives = sample_taco_indices(
        eligible, eligible, 5, k, torch.Generator().manual_seed(0), documents=batch["document_ids"],
        negative_unit=negative_unit)
    content = [int(i) for i in torch.nonzero(eligible.reshape(-1)).squeeze(1)]

    def allowed_positives(a: int) -> list[int]:  # written from the paper: nearby, same context
        return [c for c in content if 1 <= abs(c - a) <= 2 and unit_of(batch, c) == unit_of(batch, a)]

    def allowed_negatives(a: int) -> list[int]:  # other contexts: other documents (or other rows)
        if negative_unit == "row":
            return [c for c in content if c // length != a // length]
        return [c for c in content if unit_of(batch, c) != unit_of(batch, a)]

    # every content token with a same-document neighbour is an anchor; the 1-token document is not
    assert anchors.tolist() == [a for a in content if allowed_positives(a)]
    assert 7 not in anchors.tolist()  # row 0, column 7: the one-token document
    for n, a in enumerate(anchors.tolist()):
        assert positives[n].item() in allowed_positives(a)
        allowed = allowed_negatives(a)
        picked = negatives[n].tolist()
        assert set(picked) <= set(allowed), (a, sorted(set(picked) - set(allowed)))
        counts = np.bincount([allowed.index(p) for p in picked], minlength=len(allowed))
        assert counts.min() > 0  # every token of every other document can be drawn ...
        expected = k / len(allowed)  # ... uniformly (within 6 standard deviations)
        assert np.abs(counts - expected).max() < 6 * np.sqrt(expected)
    if negative_unit == "document":  # tokens of the other documents of the anchor's own row are negatives
        row0 = anchors // length == 0
        assert (negatives[row0] // length == 0).any()


def test_positives_cover_the_whole_window_inside_the_document():
    batch = packed_batch()
    eligible = content_tokens(batch)
    seen: dict[int, set[int]] = {}
    for seed in range(200):
        anchors, positives, _ = sample_taco_indices(eligible, eligible, 5, 1, torch.Generator().manual_seed(seed),
                                                    documents=batch["document_ids"])
        for a, p in zip(anchors.tolist(), positives.tolist()):
            seen.setdefault(a, set()).add(p)
    assert seen[1] == {2, 3}  # first token of row 0: right neighbours only
    assert seen[5] == {3, 4}  # last token of document 0: never the [SEP], the 1-token document or beyond
    assert seen[9] == {10, 11}  # first token of document 2: nothing of the documents before it


def test_taco_objective_reads_document_ids():
    batch = make_batch(seed=3)
    n = int(batch["attention_mask"][0].sum())
    batch["input_ids"][0, n // 2] = SEP  # a document boundary in the middle of row 0
    for key in ("masked_ids", "span_masked_ids", "shuffled_ids"):
        batch[key][0, n // 2] = SEP
    batch["mlm_labels"][0, n // 2] = -100
    batch["special_mask"] = batch["special_mask"] | (batch["input_ids"] == SEP)
    batch["document_ids"] = torch.from_numpy(document_ids(batch["input_ids"].numpy(), batch["special_mask"].numpy(), SEP))
    assert batch["document_ids"][0].max() == 1
    model = tiny_model({"taco": 1.0}, dropout=0.0, attention_dropout=0.0)
    loss, _ = model(batch)
    out = model.bert(batch["masked_ids"], batch["attention_mask"])
    g = (out.last_hidden - out.embedding_output).reshape(-1, out.last_hidden.shape[-1])
    eligible = content_tokens(batch)

    def expected(documents):
        gen = torch.Generator().manual_seed(sampling_seed(0, int(batch["sample_index"][0])))
        return token_contrastive_loss(g, *sample_taco_indices(eligible, eligible, 5, 50, gen, documents=documents), 0.07)

    torch.testing.assert_close(loss, expected(batch["document_ids"]))
    assert not torch.allclose(loss, expected(None))  # the row-only sampling is a different loss
