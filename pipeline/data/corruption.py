"""Corruption views of a packed batch: BERT / whole-word masking, InfoWord spans, COCO-LM crops,
CAPT shuffles — the one home of all masking and noising in the project.

Determinism: every random number a sample uses comes from the corruption streams of
`pipeline.seeding` (a function of seed, global sample index, stream and position), so the same
sample gets the same corruption after a resume and a different one in every epoch.

"Content" positions are those that hold no structure token (`pipeline.data.batch.STRUCTURE_TOKENS`:
[CLS]/[SEP]/[PAD]); only content is masked, replaced, shuffled or cropped, and no special token
(`pipeline.data.batch.SPECIAL_TOKEN_NAMES`) is ever drawn as a random replacement.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from pipeline.data.batch import IGNORE_INDEX, STRUCTURE_TOKENS, check_views, right_padded_lengths, special_ids
from pipeline.seeding import CorruptionStream, hash_uniform, hash_uniform_at, span_rng


def _budget(counts: np.ndarray, fraction: float) -> np.ndarray:
    """round(fraction * n), at least 1 where n > 0 (BERT's rule for how many tokens to predict)."""
    k = np.floor(counts * fraction + 0.5).astype(np.int64)
    return np.where(counts > 0, np.maximum(k, 1), 0)


def select_tokens(candidates: np.ndarray, u: np.ndarray, fraction: float) -> np.ndarray:
    """Exactly round(fraction * n) random candidate positions per row (n = candidates in the row)."""
    keys = np.where(candidates, u, 2.0)
    k = _budget(candidates.sum(1), fraction)
    threshold = np.take_along_axis(np.sort(keys, axis=1), np.maximum(k - 1, 0)[:, None], axis=1)
    return candidates & (keys <= threshold) & (k[:, None] > 0)


def word_ids(candidates: np.ndarray, word_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(word number of every candidate position (-1 elsewhere), word-start flags used).

    A candidate starts a word at a stored word start or right after a special token, so every
    candidate belongs to exactly one word made of contiguous candidates.
    """
    after_special = np.ones_like(candidates)
    after_special[:, 1:] = ~candidates[:, :-1]
    starts = candidates & (word_starts.astype(bool) | after_special)
    ids = np.cumsum(starts, axis=1) - 1
    return np.where(candidates, ids, -1), starts


def select_whole_words(candidates: np.ndarray, word_starts: np.ndarray, u: np.ndarray, fraction: float) -> np.ndarray:
    """Whole words in random order while the selected sub-tokens stay within round(fraction * n).

    Words are taken in the order of their random keys and the first word that would overflow the
    budget ends the selection (at least one word is always taken), so rows land at or just under
    the budget and a word is never split.
    """
    batch, length = candidates.shape
    ids, starts = word_ids(candidates, word_starts)
    rows = np.repeat(np.arange(batch), length).reshape(batch, length)
    in_word = ids >= 0
    word_len = np.bincount((rows * length + ids)[in_word], minlength=batch * length).reshape(batch, length)
    word_key = np.full((batch, length), 2.0)
    word_key[rows[starts], ids[starts]] = u[starts]
    order = np.argsort(word_key, axis=1, kind="stable")
    cumulative = np.cumsum(np.take_along_axis(word_len, order, axis=1), axis=1)
    k = _budget(candidates.sum(1), fraction)
    take_sorted = cumulative <= k[:, None]
    take_sorted[:, 0] |= k > 0
    take_word = np.zeros((batch, length), dtype=bool)
    np.put_along_axis(take_word, order, take_sorted, axis=1)
    return in_word & take_word[rows, np.maximum(ids, 0)]


def replace_selected(
    input_ids: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    u_action: np.ndarray,
    u_token: np.ndarray,
    mask_id: int,
    random_ids: np.ndarray,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """BERT's 80/10/10 at the selected positions (`rows`, `cols`; one uniform pair each):
    [MASK] / a random non-special token / unchanged. Returns (masked ids, labels = -100 elsewhere)."""
    masked = input_ids.copy()
    labels = np.full_like(input_ids, IGNORE_INDEX)
    labels[rows, cols] = input_ids[rows, cols]
    to_mask = u_action < mask_fraction
    to_random = ~to_mask & (u_action < mask_fraction + random_fraction)
    masked[rows[to_mask], cols[to_mask]] = mask_id
    picks = np.minimum((u_token[to_random] * len(random_ids)).astype(np.int64), len(random_ids) - 1)
    masked[rows[to_random], cols[to_random]] = random_ids[picks]
    return masked, labels


def span_mask_rows(
    candidates: np.ndarray,
    word_starts: np.ndarray,
    rngs: Sequence[np.random.Generator],
    budget_fraction: float = 0.15,
    mean: float = 5.0,
    std: float = 1.0,
    min_words: int = 1,
    max_words: int = 10,
) -> np.ndarray:
    """InfoWord span masking: span number per position, [B, L] (-1 = not masked); row i uses rngs[i].

    Per row, repeatedly draw n ~ N(mean, std) rounded and clipped to [min_words, max_words] whole
    words and a uniform start word; the span stays inside one segment (never crosses [SEP]) and
    never overlaps an earlier span. A span that would overflow round(budget_fraction * n_subwords)
    loses words from its end; sampling stops at the budget (or after a bounded number of draws).
    Spans are numbered left to right.
    """
    _, starts = word_ids(candidates, word_starts)
    next_position_continues = np.zeros_like(candidates)
    next_position_continues[:, :-1] = candidates[:, 1:] & ~starts[:, 1:]
    word_ends = candidates & ~next_position_continues  # last sub-token of each word
    budgets = _budget(candidates.sum(1), budget_fraction)
    out = np.full(candidates.shape, -1, dtype=np.int64)
    for row, rng in enumerate(rngs):
        start_pos = np.flatnonzero(starts[row])
        n_words, budget = len(start_pos), int(budgets[row])
        if n_words == 0:
            continue
        end_pos = np.flatnonzero(word_ends[row]) + 1  # exclusive
        segment = np.cumsum(np.append(True, start_pos[1:] > end_pos[:-1])).tolist()  # a gap = a special between words
        start_list, end_list = start_pos.tolist(), end_pos.tolist()
        draws = 20 + 10 * budget
        lengths = np.clip(np.rint(rng.normal(mean, std, draws)), min_words, max_words).astype(np.int64).tolist()
        firsts = rng.integers(0, n_words, draws).tolist()
        taken = bytearray(candidates.shape[1])
        spans: list[tuple[int, int]] = []
        masked = 0
        for n, first in zip(lengths, firsts):
            if masked >= budget:
                break
            last = first
            while last + 1 < min(first + n, n_words) and segment[last + 1] == segment[first]:
                last += 1
            while last >= first and masked + end_list[last] - start_list[first] > budget:
                last -= 1
            if last < first:
                continue
            lo, hi = start_list[first], end_list[last]
            if any(taken[lo:hi]):
                continue
            taken[lo:hi] = b"\x01" * (hi - lo)
            spans.append((lo, hi))
            masked += hi - lo
        for number, (lo, hi) in enumerate(sorted(spans)):
            out[row, lo:hi] = number
    return out


def document_ids(ids: np.ndarray, structure: np.ndarray, sep_id: int) -> np.ndarray:
    """Document number of every content position of packed rows, -1 at structure tokens, [B, L].

    FULL packing (`data_prep/packing.py`, docs/data.md#packing) joins documents with a `[SEP]` after
    each and wraps every row in `[CLS] ... [SEP]`, so the document of a content token is the number
    of `[SEP]`s before it in its row (0, 1, ...). A document cut at a row boundary continues in
    another row; that row numbers its piece from 0 again (rows do not know their neighbours).
    """
    sep = ids == sep_id
    before = np.cumsum(sep, axis=1) - sep
    return np.where(structure, -1, before).astype(np.int64)


def span_starts(span_index: np.ndarray) -> np.ndarray:
    """[B, L] column of the first position of the span each position belongs to (-1 outside spans)."""
    in_span = span_index >= 0
    first = in_span.copy()
    first[:, 1:] &= span_index[:, 1:] != span_index[:, :-1]
    cols = np.broadcast_to(np.arange(span_index.shape[1]), span_index.shape)
    return np.where(in_span, np.maximum.accumulate(np.where(first, cols, -1), axis=1), -1)


def span_widths(span_index: np.ndarray) -> np.ndarray:
    """[B, S] int64 tokens in span s of row b (0 where the row has fewer spans), S = the most spans
    of a row (`span_index` numbers each row's spans 0, 1, ...; -1 outside spans)."""
    batch = span_index.shape[0]
    num = int(span_index.max()) + 1 if span_index.size else 0
    out = np.zeros((batch, max(num, 0)), dtype=np.int64)
    rows, cols = np.nonzero(span_index >= 0)
    np.add.at(out, (rows, span_index[rows, cols]), 1)
    return out


def crop(input_ids: np.ndarray, lengths: np.ndarray, u: np.ndarray, fraction: float, cls_id: int, sep_id: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """COCO-LM crop: a random contiguous `fraction` of each row's content, re-wrapped as [CLS] .. [SEP].

    Content = positions 1 .. length-2; crop length = max(1, round(fraction * n)); the start is
    uniform over the valid offsets. Returns (crop_ids, crop_attention_mask), both [B, W] with
    W = longest crop + 2 <= L: the columns after every row's [SEP] would be padding in every row,
    and cutting them lets a batch of equal-length crops (packed rows) run without any padding.
    """
    batch, length = input_ids.shape
    n = np.maximum(lengths - 2, 0)
    crop_len = np.where(n > 0, np.maximum(np.floor(fraction * n + 0.5).astype(np.int64), 1), 0)
    start = np.minimum((u * (n - crop_len + 1)).astype(np.int64), n - crop_len)
    cols = np.arange(length)[None, :]
    source = np.clip(start[:, None] + cols, 0, length - 1)  # column j (1-based crop position j) reads 1 + start + j - 1
    out = np.take_along_axis(input_ids, source, axis=1)
    out = np.where(cols <= crop_len[:, None], out, pad_id)
    out[:, 0] = cls_id
    out[np.arange(batch), crop_len + 1] = sep_id
    width = int(crop_len.max()) + 2 if batch else 2
    return out[:, :width], (cols <= crop_len[:, None] + 1).astype(np.int64)[:, :width]


def shuffle_within_window(input_ids: np.ndarray, candidates: np.ndarray, u: np.ndarray, window: int) -> np.ndarray:
    """CAPT / Lample et al. local shuffle: sort content by position + U(0, window + 1).

    Every token moves at most `window` positions; specials stay where they are and tokens never
    cross a special (the sort key is offset by the number of specials seen so far).
    """
    length = input_ids.shape[1]
    positions = np.arange(length, dtype=np.float64)[None, :]
    segment = np.cumsum(~candidates, axis=1).astype(np.float64) * (2 * length + 2 * window + 2)
    keys = segment + positions + np.where(candidates, u * (window + 1), 0.0)
    order = np.argsort(keys, axis=1, kind="stable")
    return np.take_along_axis(input_ids, order, axis=1)


def check_options(options: Mapping[str, Any], where: str = "data.corruption") -> None:
    """The values of `CorruptionCollator`'s keyword options (rates in range, ...), checked before any
    compute by building a collator on placeholder special tokens: a ValueError naming `where`."""
    try:
        CorruptionCollator(("original",), {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}, 8, 0, **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from err


class CorruptionCollator:
    """Builds the batch contract's tensors for the requested views (`pipeline.data.batch`).

    `collate(input_ids, word_starts, sample_index)` is the fast path used by `PretrainBatches`;
    calling the collator on a list of `{"input_ids", "word_starts", "sample_index"}` dicts works as a
    DataLoader `collate_fn`.

    InfoWord span replacement (`span_mask_fraction`, `span_random_fraction`): by default every span
    position becomes `[MASK]` — InfoWord's DIM needs the n-gram gone from the sentence, or "the task
    becomes trivial" (Kong et al. 2020, Sec. 4). 0.8 / 0.1 gives SpanBERT's scheme (Joshi et al.
    2020, Sec. 3.1, which InfoWord's span sampling follows): per *span*, 80% `[MASK]` everywhere,
    10% a random non-special token at each position, 10% unchanged; labels cover every span position.

    `plans` (the objectives' `host_plan`s, `PretrainModel.host_plans`): callables run on every
    collated batch, whose extra keys (index tensors an objective would otherwise find on the
    device, e.g. TACO's anchors) join the batch — built here, in the loader's worker processes and
    pinned with the rest, so the step never reads device data on the host.

    Selection rate: `mask_rate` (default 0.15, BERT's) is the fraction of content tokens every
    selecting view picks — `masked` (exactly round(rate * n) per row), `wwm_masked` and
    `span_masked` (whole words / spans up to that budget). `mlm_probability` (masked, wwm_masked) and
    `span_budget` (span_masked) override it for one kind of view; unset, they are `mask_rate`.
    ModernBERT and Ettin mask 30% (`mask_rate: 0.3` in the modernbert-* presets; Warner et al. 2024
    after Wettig et al. 2023, "Should You Mask 15% in Masked Language Modeling?").
    """

    def __init__(
        self,
        views: Iterable[str],
        special_tokens: Mapping[str, int],
        vocab_size: int,
        seed: int,
        mask_rate: float = 0.15,
        mlm_probability: Optional[float] = None,
        mask_fraction: float = 0.8,
        random_fraction: float = 0.1,
        span_budget: Optional[float] = None,
        span_mean: float = 5.0,
        span_std: float = 1.0,
        span_min_words: int = 1,
        span_max_words: int = 10,
        span_mask_fraction: float = 1.0,
        span_random_fraction: float = 0.0,
        crop_fraction: float = 0.9,
        shuffle_window: int = 3,
        plans: Sequence[Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]] = (),
    ) -> None:
        self.views = check_views(views)
        self.plans = tuple(plans)
        self._structure_ids = np.array(special_ids(special_tokens, STRUCTURE_TOKENS), dtype=np.int64)
        special_ids(special_tokens, ("mask",))  # masking writes it: its absence is an error here, not later
        never_drawn = {int(v) for v in special_tokens.values()}
        mlm_probability = mask_rate if mlm_probability is None else mlm_probability
        span_budget = mask_rate if span_budget is None else span_budget
        rates = {"mask_rate": mask_rate, "mlm_probability": mlm_probability, "span_budget": span_budget,
                 "crop_fraction": crop_fraction}
        for name, value in rates.items():
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} {value}: must be in (0, 1]")
        if mask_fraction < 0 or random_fraction < 0 or mask_fraction + random_fraction > 1:
            raise ValueError(f"mask_fraction {mask_fraction} + random_fraction {random_fraction}: must be within [0, 1]")
        if span_mask_fraction < 0 or span_random_fraction < 0 or span_mask_fraction + span_random_fraction > 1:
            raise ValueError(f"span_mask_fraction {span_mask_fraction} + span_random_fraction {span_random_fraction}: "
                             "must be within [0, 1]")
        if not 1 <= span_min_words <= span_max_words:
            raise ValueError(f"span_min_words {span_min_words} / span_max_words {span_max_words}: need 1 <= min <= max")
        if shuffle_window < 0:
            raise ValueError(f"shuffle_window {shuffle_window}: must be >= 0")
        self.special_tokens = dict(special_tokens)
        self.vocab_size, self.seed = vocab_size, seed
        self.mlm_probability, self.mask_fraction, self.random_fraction = mlm_probability, mask_fraction, random_fraction
        self.span = {"budget_fraction": span_budget, "mean": span_mean, "std": span_std, "min_words": span_min_words, "max_words": span_max_words}
        self.span_mask_fraction, self.span_random_fraction = span_mask_fraction, span_random_fraction
        self.crop_fraction, self.shuffle_window = crop_fraction, shuffle_window
        self._random_ids = np.array([i for i in range(vocab_size) if i not in never_drawn], dtype=np.int64)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return self.collate(
            np.stack([np.asarray(s["input_ids"]) for s in samples]),
            np.stack([np.asarray(s["word_starts"]) for s in samples]),
            np.array([int(s["sample_index"]) for s in samples], dtype=np.int64),
        )

    def collate(self, input_ids: np.ndarray, word_starts: np.ndarray, sample_index: np.ndarray) -> dict[str, torch.Tensor]:
        ids = input_ids.astype(np.int64)
        sample_index = np.asarray(sample_index, dtype=np.int64)
        special = np.isin(ids, self._structure_ids)
        candidates = ~special
        attention = ids != self.special_tokens["pad"]
        batch: dict[str, np.ndarray] = {
            "input_ids": ids,
            "attention_mask": attention.astype(np.int64),
            "special_mask": special,
            "word_starts": word_starts.astype(bool) & candidates,
            "sample_index": sample_index,
            "document_ids": document_ids(ids, special, self.special_tokens["sep"]),
            "content_positions": np.flatnonzero(candidates & attention),  # row-major: the flat order
        }
        width = ids.shape[1]
        host: dict[str, torch.Tensor] = {}  # host-side layout keys (`pipeline.data.batch.HOST_KEYS`)
        lengths = right_padded_lengths(attention)
        if lengths is not None:
            host["seqlens"] = lengths

        def uniform(stream: int) -> np.ndarray:
            return hash_uniform(self.seed, sample_index, stream, width)

        if self.views & {"masked", "wwm_masked"}:
            if "masked" in self.views:
                selected = select_tokens(candidates, uniform(CorruptionStream.SELECT), self.mlm_probability)
            else:
                selected = select_whole_words(candidates, word_starts, uniform(CorruptionStream.WORD), self.mlm_probability)
            rows, cols = np.nonzero(selected)
            batch["masked_ids"], batch["mlm_labels"] = replace_selected(
                ids, rows, cols,
                hash_uniform_at(self.seed, sample_index, CorruptionStream.ACTION, rows, cols),
                hash_uniform_at(self.seed, sample_index, CorruptionStream.RANDOM_TOKEN, rows, cols),
                self.special_tokens["mask"], self._random_ids, self.mask_fraction, self.random_fraction,
            )
            batch["mlm_positions"] = rows * width + cols  # np.nonzero is row-major: the flat order
        if "span_masked" in self.views:
            rngs = [span_rng(self.seed, int(i)) for i in sample_index]
            span_index = span_mask_rows(candidates, word_starts, rngs, **self.span)
            # [MASK] / random tokens / unchanged decided once per span (SpanBERT's span-level 80/10/10),
            # keyed by the span's first column; the default (1.0, 0.0) masks every span position.
            rows, cols = np.nonzero(span_index >= 0)
            first_cols = span_starts(span_index)[rows, cols]
            batch["span_masked_ids"], batch["span_labels"] = replace_selected(
                ids, rows, cols,
                hash_uniform_at(self.seed, sample_index, CorruptionStream.SPAN_ACTION, rows, first_cols),
                hash_uniform_at(self.seed, sample_index, CorruptionStream.SPAN_RANDOM_TOKEN, rows, cols),
                self.special_tokens["mask"], self._random_ids, self.span_mask_fraction, self.span_random_fraction,
            )
            batch["span_index"] = span_index
            batch["span_positions"] = rows * width + cols  # np.nonzero is row-major: the flat order
            host["span_widths"] = torch.from_numpy(span_widths(span_index))
        if "crop" in self.views:
            batch["crop_ids"], batch["crop_attention_mask"] = crop(
                ids, attention.sum(1), uniform(CorruptionStream.CROP)[:, 0], self.crop_fraction,
                self.special_tokens["cls"], self.special_tokens["sep"], self.special_tokens["pad"],
            )
            crop_lengths = right_padded_lengths(batch["crop_attention_mask"])
            if crop_lengths is not None:
                host["crop_seqlens"] = crop_lengths
        if "shuffled" in self.views:
            batch["shuffled_ids"] = shuffle_within_window(ids, candidates, uniform(CorruptionStream.SHUFFLE), self.shuffle_window)
        out = {**{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}, **host}
        for plan in self.plans:
            out.update({k: v for k, v in plan(out).items() if k not in out})
        return out
