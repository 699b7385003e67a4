"""The masking rate (`data.corruption.mask_rate`, issue 38): one option for every view that selects
(BERT `masked`, `wwm_masked`, InfoWord `span_masked`), 30% in the ModernBERT presets, and 15% — the
default — bit for bit what the collator produced before the option existed."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from pipeline.data.batch import IGNORE_INDEX
from pipeline.config.checks import ConfigError
from pipeline.train.run_config import load_config
from pipeline.data.corruption import CorruptionCollator
from tests.data.test_corruption import SPECIALS, VOCAB, synthetic_rows

SELECTING = {"masked": "mlm_labels", "wwm_masked": "mlm_labels", "span_masked": "span_labels"}

#: sha256 of every output tensor of `digest(view)` computed with the collator of commit e3c46db
#: (before `mask_rate` existed): the default 15% must not move a single bit.
BEFORE = {
    "masked": "25fd7bb53ba29a1112b3617e7c150714738a1607a30da7a1ad93940d677e840d",
    "wwm_masked": "cc528f9e7b5ab1b0a6d5257dc054b35b0ece5ccd57793a0c5fb8a90ffc3ed406",
    "span_masked": "833dddd1c911b1b7397a8296396b3bc9ba81b47996e256f35f371035596d8a2b",
}


def digest(view: str, **options) -> str:
    ids, starts = synthetic_rows(batch=64, length=128, seed=3)
    out = CorruptionCollator((view,), SPECIALS, VOCAB, 11, **options).collate(ids, starts, np.arange(1000, 1064))
    h = hashlib.sha256()
    for key in sorted(out):
        h.update(key.encode())
        h.update(out[key].numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("view", list(SELECTING))
def test_default_15_percent_is_bitwise_unchanged(view):
    assert digest(view) == BEFORE[view]
    assert digest(view, mask_rate=0.15) == BEFORE[view]
    per_view = {"span_budget": 0.15} if view == "span_masked" else {"mlm_probability": 0.15}
    assert digest(view, mask_rate=0.3, **per_view) == BEFORE[view]  # the per-view option wins


@pytest.mark.parametrize("rate", [0.15, 0.3, 0.4])
@pytest.mark.parametrize("view", list(SELECTING))
def test_selected_fraction_matches_the_rate(view, rate):
    ids, starts = synthetic_rows(batch=1024, length=128, seed=5)
    out = CorruptionCollator((view,), SPECIALS, VOCAB, 3, mask_rate=rate).collate(ids, starts, np.arange(1024))
    selected = (out[SELECTING[view]] != IGNORE_INDEX).sum(1)
    content = (~out["special_mask"]).sum(1)
    budget = torch.clamp(torch.floor(content * rate + 0.5), min=1).long()
    if view == "masked":
        assert torch.equal(selected, budget)  # exactly round(rate * n) per row
    elif view == "span_masked":  # spans up to the budget, the last one shortened to fit
        assert (selected <= budget).all()
    else:  # whole words up to the budget; only a first word longer than a small budget may overflow it
        assert (selected[budget >= 8] <= budget[budget >= 8]).all()
    fraction = selected.sum().item() / content.sum().item()
    # The only deviation is per-row rounding and a word or span that would overflow (<= ~1 token per
    # row of ~110): 0.01 is several times that, and far below the gap between the rates tested.
    assert abs(fraction - rate) < 0.01, (view, rate, fraction)


def test_bad_rates_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="mask_rate 0.0"):
        CorruptionCollator(("masked",), SPECIALS, VOCAB, 0, mask_rate=0.0)
    with pytest.raises(ValueError, match="span_budget 1.5"):
        CorruptionCollator(("span_masked",), SPECIALS, VOCAB, 0, mask_rate=0.3, span_budget=1.5)
    with pytest.raises(ConfigError, match="data.corruption.mask_rat.*mask_rate"):
        load_config("tiny-mlm", ["data.shards_dir=/nowhere", "data.corruption={mask_rat: 0.3}"])
    # the values are checked with the config, before any compute (not at the collator's construction)
    with pytest.raises(ConfigError, match=r"^data.corruption: mask_rate 1.5: must be in \(0, 1\]$"):
        load_config("tiny-mlm", ["data.shards_dir=/nowhere", "data.corruption={mask_rate: 1.5}"])
    with pytest.raises(ConfigError, match=r"^data.corruption: span_budget 0.0: must be in \(0, 1\]$"):
        load_config("modernbert-tiny", ["data.shards_dir=/nowhere", "data.corruption={span_budget: 0.0}"])


@pytest.mark.parametrize("preset", ["modernbert-tiny", "modernbert-small", "modernbert-base", "modernbert-large",
                                    "modernbert-large-24", "modernbert-long", "modernbert-long-2phase"])
def test_modernbert_presets_on_their_recipe(preset):
    """30% masking, StableAdamW and warmup-stable-decay with a 1-sqrt decay (issue 38)."""
    cfg = load_config(preset, ["data.shards_dir=/nowhere"])
    assert (cfg.optim.name, cfg.optim.schedule, cfg.optim.decay_shape) == ("stable_adamw", "wsd", "1-sqrt")
    assert cfg.data.corruption.get("mask_rate") == 0.3
    assert "mlm_probability" not in cfg.data.corruption and "span_budget" not in cfg.data.corruption
