"""pipeline.data.corruption: each view matches its specification on large samples, deterministically."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.batch import IGNORE_INDEX
from pipeline.data.corruption import CorruptionCollator, word_ids
from pipeline.seeding import hash_uniform, hash_uniform_at

SPECIALS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
VOCAB = 1000


def synthetic_rows(batch: int = 512, length: int = 128, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Packed-looking rows: [CLS] doc [SEP] doc [SEP] [PAD]..., geometric word lengths with mean 1.3
    sub-tokens (about what an English WordPiece vocabulary gives)."""
    rng = np.random.default_rng(seed)
    used = np.where(np.arange(batch) % 3 == 0, rng.integers(length // 2, length, batch), length)
    cols = np.arange(length)[None, :]
    content = (cols >= 1) & (cols < used[:, None] - 1)
    ids = np.where(content, rng.integers(5, VOCAB, (batch, length)), SPECIALS["pad"]).astype(np.uint16)
    ids[:, 0] = SPECIALS["cls"]
    ids[np.arange(batch), used - 1] = SPECIALS["sep"]
    inner = np.flatnonzero(np.arange(batch) % 2)
    ids[inner, rng.integers(10, used[inner] - 10)] = SPECIALS["sep"]  # a document boundary inside the row
    starts = (content & (rng.random((batch, length)) < 1 / 1.3)).astype(np.uint8)
    starts[:, 1] = 1
    return ids, starts


def collate(views, rows=None, seed=7, first_index=0, **options) -> dict[str, torch.Tensor]:
    ids, starts = rows if rows is not None else synthetic_rows()
    collator = CorruptionCollator(views, SPECIALS, VOCAB, seed, **options)
    return collator.collate(ids, starts, np.arange(first_index, first_index + len(ids)))


def test_bert_masking_15_percent_80_10_10_never_specials() -> None:
    ids, starts = synthetic_rows(batch=2048)
    batch = collate(("masked",), (ids, starts))
    original, masked, labels = batch["input_ids"], batch["masked_ids"], batch["mlm_labels"]
    special = batch["special_mask"]
    selected = labels != IGNORE_INDEX
    content = (~special).sum(1)
    expected = torch.clamp(torch.floor(content * 0.15 + 0.5), min=1)
    assert torch.equal(selected.sum(1), expected.long())  # exactly round(15%) per sequence
    assert not (selected & special).any()
    assert torch.equal(labels[selected], original[selected])
    assert torch.equal(masked[~selected], original[~selected])
    n = selected.sum().item()
    to_mask = (masked == SPECIALS["mask"]) & selected
    changed = (masked != original) & selected & ~to_mask
    unchanged = (masked == original) & selected
    assert abs(to_mask.sum().item() / n - 0.8) < 0.01
    # A random replacement can draw the original token (1 in 995); it then counts as unchanged.
    assert abs(changed.sum().item() / n - 0.1) < 0.01
    assert abs(unchanged.sum().item() / n - 0.1) < 0.01
    replaced_ids = masked[changed]
    assert replaced_ids.min() >= 5 and replaced_ids.max() < VOCAB  # never a special token
    # Positions are uniform over content: no position bias beyond noise.
    per_position = selected[:, 1:100].float().mean(0)
    assert per_position.min() > 0.11 and per_position.max() < 0.19


def test_masking_is_dynamic_deterministic_and_independent_of_the_batch() -> None:
    ids, starts = synthetic_rows(batch=16)
    views = ("masked", "span_masked", "crop", "shuffled")
    a = collate(views, (ids, starts), seed=1, first_index=100)
    b = collate(views, (ids, starts), seed=1, first_index=100)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    later_epoch = collate(views, (ids, starts), seed=1, first_index=100 + 16)  # same rows, later positions
    other_seed = collate(views, (ids, starts), seed=2, first_index=100)
    for other in (later_epoch, other_seed):
        assert not torch.equal(other["masked_ids"], a["masked_ids"])
        assert not torch.equal(other["span_masked_ids"], a["span_masked_ids"])
    # Sample 105 alone gets exactly what it got inside the batch of 16.
    alone = CorruptionCollator(views, SPECIALS, VOCAB, 1).collate(ids[5:6], starts[5:6], np.array([105]))
    for key in alone:
        if key.endswith("_positions"):  # flat indices into the batch: checked in the next test
            continue
        width = alone[key].shape[1] if alone[key].dim() > 1 else None  # a crop view is as wide as its longest crop
        row = a[key][5] if width is None else a[key][5, :width]
        assert torch.equal(alone[key][0], row), key
        if width is not None:
            assert (a[key][5, width:] == (SPECIALS["pad"] if key == "crop_ids" else 0)).all(), key


def test_positions_and_seqlens_describe_the_batch_computed_on_the_host() -> None:
    """`*_positions` are the flat selected positions and `*seqlens` the real-token counts of
    right-padded rows (`pipeline.data.batch`): what the objectives and the encoder read instead of a sync."""
    ids, starts = synthetic_rows(batch=24)
    batch = collate(("masked", "span_masked", "crop"), (ids, starts), seed=3)
    for labels, positions in (("mlm_labels", "mlm_positions"), ("span_labels", "span_positions")):
        expected = torch.nonzero(batch[labels].reshape(-1) != IGNORE_INDEX).squeeze(1)
        assert torch.equal(batch[positions], expected), positions
    assert torch.equal(batch["seqlens"], batch["attention_mask"].sum(1))
    assert torch.equal(batch["crop_seqlens"], batch["crop_attention_mask"].sum(1))
    assert batch["crop_ids"].shape[1] == int(batch["crop_seqlens"].max()) < ids.shape[1]  # no all-padding column
    full = synthetic_rows(batch=6, seed=4)[0]
    full[:, -1] = SPECIALS["sep"]
    full[full == SPECIALS["pad"]] = 7  # every row packed to the end: nothing is padded
    packed = collate(("crop",), (full, synthetic_rows(batch=6, seed=4)[1]))
    assert (packed["seqlens"] == full.shape[1]).all() and (packed["crop_seqlens"] == packed["crop_ids"].shape[1]).all()
    holes = ids.copy()
    holes[0, 5] = SPECIALS["pad"]  # a pad inside a row: not right-padded, so no layout is vouched for
    assert "seqlens" not in collate(("masked",), (holes, starts))


def test_hash_uniform_is_uniform_and_decorrelated() -> None:
    u = hash_uniform(0, np.arange(4000), 1, 64)
    assert abs(u.mean() - 0.5) < 0.005 and u.min() >= 0 and u.max() < 1
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert counts.min() > 0.95 * u.size / 20
    v = hash_uniform(0, np.arange(4000), 2, 64)
    assert abs(np.corrcoef(u.ravel(), v.ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.01  # neighbouring samples
    rows, cols = np.array([0, 5, 3999, 17]), np.array([63, 0, 12, 40])
    np.testing.assert_array_equal(hash_uniform_at(0, np.arange(4000), 1, rows, cols), u[rows, cols])


def _words(row_starts: np.ndarray, row_candidates: np.ndarray) -> list[range]:
    ids, _ = word_ids(row_candidates[None], row_starts[None])
    ids = ids[0]
    return [range(int(np.flatnonzero(ids == w)[0]), int(np.flatnonzero(ids == w)[-1]) + 1) for w in range(ids.max() + 1)]


def test_whole_word_masking_selects_whole_words_near_15_percent() -> None:
    ids, starts = synthetic_rows(batch=1024)
    batch = collate(("wwm_masked",), (ids, starts))
    selected = (batch["mlm_labels"] != IGNORE_INDEX).numpy()
    candidates = ~batch["special_mask"].numpy()
    assert not (selected & ~candidates).any()
    fractions = selected.sum(1) / candidates.sum(1)
    budget = np.floor(candidates.sum(1) * 0.15 + 0.5)
    assert (selected.sum(1) <= np.maximum(budget, 4)).all()  # never over budget (unless one word is bigger)
    assert 0.125 < fractions.mean() <= 0.15
    for i in range(0, 1024, 97):
        for word in _words(starts[i], candidates[i]):
            assert selected[i, word.start : word.stop].all() or not selected[i, word.start : word.stop].any()
    masked = batch["masked_ids"][torch.from_numpy(selected)]
    assert abs((masked == SPECIALS["mask"]).float().mean().item() - 0.8) < 0.02


def test_span_masking_infoword_statistics() -> None:
    ids, starts = synthetic_rows(batch=256, length=512)
    batch = collate(("span_masked",), (ids, starts))
    span_index = batch["span_index"].numpy()
    in_span = span_index >= 0
    candidates = ~batch["special_mask"].numpy()
    assert not (in_span & ~candidates).any()
    assert torch.equal(batch["span_masked_ids"][torch.from_numpy(in_span)], torch.full((int(in_span.sum()),), SPECIALS["mask"]))
    assert torch.equal(batch["span_labels"][torch.from_numpy(in_span)], batch["input_ids"][torch.from_numpy(in_span)])
    assert (batch["span_labels"][torch.from_numpy(~in_span)] == IGNORE_INDEX).all()
    budget = np.floor(candidates.sum(1) * 0.15 + 0.5)
    assert (in_span.sum(1) <= budget).all()
    assert in_span.sum(1).mean() / budget.mean() > 0.95  # "until 15% of the sub-words"
    lengths_in_words = []
    for i in range(len(ids)):
        words = _words(starts[i], candidates[i])
        start_of = {w.start: w for w in words}
        spans = span_index[i][in_span[i]]
        assert spans.tolist() == sorted(spans.tolist())  # numbered left to right
        for s in range(spans.max() + 1 if len(spans) else 0):
            where = np.flatnonzero(span_index[i] == s)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous, no [SEP] inside
            assert where[0] in start_of  # starts at a word start ...
            n_words = sum(1 for w in words if w.start >= where[0] and w.stop <= where[-1] + 1)
            assert sum(len(w) for w in words if w.start >= where[0] and w.stop <= where[-1] + 1) == len(where)  # ... whole words
            assert 1 <= n_words <= 10
            lengths_in_words.append(n_words)
    mean = float(np.mean(lengths_in_words))
    # n ~ N(5, 1): mean 5, lowered slightly by spans cut at a segment end or at the budget.
    assert 4.5 < mean < 5.1, mean
    assert np.mean(np.array(lengths_in_words) == 5) > 0.25


@pytest.mark.parametrize("fraction", [0.9, 0.5])
def test_crop_is_a_contiguous_fraction_rewrapped(fraction: float) -> None:
    ids, starts = synthetic_rows(batch=512)
    batch = collate(("crop",), (ids, starts), crop_fraction=fraction)
    crop_ids, crop_mask = batch["crop_ids"].numpy(), batch["crop_attention_mask"].numpy()
    original, lengths = batch["input_ids"].numpy(), batch["attention_mask"].numpy().sum(1)
    offsets = []
    for i in range(len(ids)):
        n = lengths[i] - 2
        k = int(np.floor(fraction * n + 0.5))
        assert crop_mask[i].sum() == k + 2
        assert crop_ids[i, 0] == SPECIALS["cls"] and crop_ids[i, k + 1] == SPECIALS["sep"]
        assert (crop_ids[i, k + 2 :] == SPECIALS["pad"]).all()
        content, piece = original[i, 1 : n + 1], crop_ids[i, 1 : k + 1]
        matches = [s for s in range(n - k + 1) if np.array_equal(content[s : s + k], piece)]
        assert matches, i
        offsets.append(matches[0] / max(1, n - k))
    assert 0.4 < np.mean(offsets) < 0.6  # start uniform over the valid offsets


def test_shuffle_moves_tokens_at_most_three_positions_and_keeps_specials() -> None:
    ids, starts = synthetic_rows(batch=512)
    batch = collate(("shuffled",), (ids, starts))
    original, shuffled = batch["input_ids"].numpy(), batch["shuffled_ids"].numpy()
    special = batch["special_mask"].numpy()
    assert np.array_equal(shuffled[special], original[special])
    moved = 0
    for i in range(len(ids)):
        assert sorted(shuffled[i].tolist()) == sorted(original[i].tolist())
        # Content ids are almost all distinct per row: locate each token's new position.
        values, counts = np.unique(original[i][~special[i]], return_counts=True)
        for v in values[counts == 1]:
            before, after = np.flatnonzero(original[i] == v)[0], np.flatnonzero(shuffled[i] == v)[0]
            assert abs(int(after) - int(before)) <= 3
            moved += before != after
    assert moved / (~special).sum() > 0.5


def test_collator_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="unknown \\['bogus'\\]"):
        CorruptionCollator(("bogus",), SPECIALS, VOCAB, 0)
    with pytest.raises(ValueError, match="choose one"):
        CorruptionCollator(("masked", "wwm_masked"), SPECIALS, VOCAB, 0)
    with pytest.raises(ValueError, match="crop_fraction 1.5"):
        CorruptionCollator(("crop",), SPECIALS, VOCAB, 0, crop_fraction=1.5)
    with pytest.raises(TypeError):
        CorruptionCollator(("masked",), SPECIALS, VOCAB, 0, not_an_option=1)


def test_list_of_samples_entry_point_matches_the_array_path() -> None:
    ids, starts = synthetic_rows(batch=4)
    collator = CorruptionCollator(("masked", "crop"), SPECIALS, VOCAB, 5)
    samples = [{"input_ids": ids[i], "word_starts": starts[i], "sample_index": 10 + i} for i in range(4)]
    a, b = collator(samples), collator.collate(ids, starts, np.arange(10, 14))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def packed_documents(seed: int = 0, seq_len: int = 48) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FULL-packed rows (data_prep's Packer) of documents whose tokens name their document
    (document d uses ids 100 * (d + 1) + ...), so a token's true document is known independently."""
    from data_prep.packing import Packer

    rng = np.random.default_rng(seed)
    packer = Packer(seq_len, SPECIALS["cls"], SPECIALS["sep"], SPECIALS["pad"], mode="full")
    rows = []
    for d in range(30):
        n = int(rng.integers(1, 40))
        packer.add_document(100 * (d + 1) + rng.integers(0, 100, n), np.ones(n, dtype=np.uint8))
        rows.extend(packer.ready())
    rows.extend(packer.finish())
    ids = np.stack([r[0] for r in rows])
    return ids, np.stack([r[1] for r in rows]), ids // 100 - 1  # the true document of content ids


def test_document_ids_number_the_documents_of_a_packed_row() -> None:
    ids, starts, truth = packed_documents()
    batch = collate(("original",), (ids, starts))
    docs, special = batch["document_ids"].numpy(), batch["special_mask"].numpy()
    assert (docs[special] == -1).all() and (docs[~special] >= 0).all()
    several = 0
    for i in range(len(ids)):
        content = np.flatnonzero(~special[i])
        true_docs = truth[i, content]
        _, expected = np.unique(true_docs, return_inverse=True)  # 0, 1, ... in order of appearance
        assert np.array_equal(docs[i, content], expected), i
        several += expected.max() > 0
    assert several > len(ids) // 2  # most rows really hold several documents


def test_span_replacement_spanbert_80_10_10_per_span() -> None:
    ids, starts = synthetic_rows(batch=1024, length=256)
    default = collate(("span_masked",), (ids, starts))
    batch = collate(("span_masked",), (ids, starts), span_mask_fraction=0.8, span_random_fraction=0.1)
    assert torch.equal(batch["span_index"], default["span_index"])  # same spans, same labels
    assert torch.equal(batch["span_labels"], default["span_labels"])
    span_index, original, corrupted = batch["span_index"].numpy(), batch["input_ids"].numpy(), batch["span_masked_ids"].numpy()
    outside = span_index < 0
    assert np.array_equal(corrupted[outside], original[outside])
    actions = []
    for i in range(len(ids)):
        for s in range(span_index[i].max() + 1):
            where = span_index[i] == s
            masked = corrupted[i, where] == SPECIALS["mask"]
            same = corrupted[i, where] == original[i, where]
            assert masked.all() or not masked.any()  # one decision per span (SpanBERT)
            actions.append("mask" if masked.all() else "keep" if same.all() else "random")
            if actions[-1] == "random":
                assert (corrupted[i, where] >= 5).all()  # never a special token
    actions = np.array(actions)
    assert len(actions) > 5000
    for action, share in (("mask", 0.8), ("random", 0.1), ("keep", 0.1)):
        assert abs(np.mean(actions == action) - share) < 0.02, action  # > 5 sigma at 5,000 spans
    with pytest.raises(ValueError, match="span_mask_fraction 0.9 \\+ span_random_fraction 0.2"):
        CorruptionCollator(("span_masked",), SPECIALS, VOCAB, 0, span_mask_fraction=0.9, span_random_fraction=0.2)
