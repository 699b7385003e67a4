"""The time-to-quality evaluation (`pipeline.study.evaluate.heldout_metrics`) evaluates the model a
converted directory holds, of either family: its masked-LM loss, accuracy and token cosine are the training
model's own on the same batches (it once loaded every export as `BertForMaskedLM`, which on a ModernBERT
export evaluates a randomly initialised BERT)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.study.evaluate import heldout_metrics, top_token_of
from pipeline.data.corruption import CorruptionCollator
from pipeline.data.reader import ShardDataset
from pipeline.monitor.health import mean_token_cosine
from pipeline.export.convert import convert
from pipeline.pretrain.build import model_from_meta
from pipeline.train.run_meta import RunMeta
from tests.train.runs import module_state, run_inprocess, tag_dir

SEQUENCES, BATCH, COS_ROWS = 16, 8, 6


def _trained_model(tag: Path) -> torch.nn.Module:
    """The training model of checkpoint `tag` with its weights, in eval mode (the reference the export is read
    against)."""
    ours = model_from_meta(RunMeta.read(tag))
    ours.load_state_dict(module_state(tag), strict=False)
    return ours.eval()


@pytest.mark.parametrize("arch", ["modernbert", "bert"])
def test_heldout_metrics_are_the_training_models_own(arch, tiny_shards_dir, tmp_path):
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, f"model.arch={arch}", "optim.warmup_steps=0", "train.total_steps=2",
                         "train.checkpoint_every=2") == 0
    exported = convert(out, tmp_path / "hf")
    top = top_token_of(tiny_shards_dir)
    metrics = heldout_metrics(exported, tiny_shards_dir, top_token=top, max_sequences=SEQUENCES, cos_rows=COS_ROWS,
                              batch_size=BATCH)

    ours = _trained_model(tag_dir(out, 2))
    dataset = ShardDataset(tiny_shards_dir)
    collator = CorruptionCollator({"masked"}, dataset.special_tokens, dataset.vocab_size, 0)
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, SEQUENCES, BATCH):
            rows = np.arange(start, start + BATCH)
            batch = collator.collate(*dataset.take(rows), rows)
            # the [MASK]ed positions only: the kept 10% are scored by copying the input
            selected = (batch["mlm_labels"] != -100) & (batch["masked_ids"] == dataset.special_tokens["mask"])
            logits = ours.cls(ours.bert(batch["masked_ids"], batch["attention_mask"]).last_hidden)[selected]
            target = batch["mlm_labels"][selected]
            loss += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(-1) == target).sum())
            count += int(selected.sum())
        rows = np.unique(np.linspace(0, len(dataset) - 1, num=COS_ROWS).round().astype(np.int64))
        clean = CorruptionCollator(("original",), dataset.special_tokens, dataset.vocab_size, 0).collate(
            *dataset.take(rows), rows)
        hidden = ours.bert(clean["input_ids"], clean["attention_mask"]).last_hidden
        cosine = mean_token_cosine(hidden, clean["attention_mask"].bool() & ~clean["special_mask"].bool())

    assert metrics["masked_tokens"] == count > 0
    assert metrics["mlm_loss"] == pytest.approx(loss / count, rel=1e-5)
    assert metrics["mlm_acc"] == correct / count
    assert metrics["token_cosine"] == pytest.approx(cosine, abs=1e-5)


def test_an_electra_export_is_read_through_its_generator_and_its_discriminator(tiny_shards_dir, tmp_path):
    """ELECTRA's export is the discriminator (no masked LM): the study converts it with its generator
    (`convert_once`) and reads every masked-LM number through `generator/` (the training generator's own
    logits) and the token cosine through the discriminator; without `generator/` it refuses by name."""
    from pipeline.study.evaluate import convert_once

    out = tmp_path / "run"
    assert run_inprocess("tiny-electra", tiny_shards_dir, out, "optim.warmup_steps=0", "train.total_steps=2",
                         "train.checkpoint_every=2") == 0
    exported = convert_once(tag_dir(out, 2), tmp_path / "hf")
    assert (exported / "generator" / "config.json").is_file()
    top = top_token_of(tiny_shards_dir)
    metrics = heldout_metrics(exported, tiny_shards_dir, top_token=top, max_sequences=SEQUENCES, cos_rows=COS_ROWS,
                              batch_size=BATCH)
    ours = _trained_model(tag_dir(out, 2))
    electra = ours.objectives["electra"]
    dataset = ShardDataset(tiny_shards_dir)
    collator = CorruptionCollator({"masked"}, dataset.special_tokens, dataset.vocab_size, 0)
    loss, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, SEQUENCES, BATCH):
            rows = np.arange(start, start + BATCH)
            batch = collator.collate(*dataset.take(rows), rows)
            selected = (batch["mlm_labels"] != -100) & (batch["masked_ids"] == dataset.special_tokens["mask"])
            h = electra.generator(electra.embeddings_project(ours.bert.embeddings(batch["masked_ids"])),
                                  batch["attention_mask"])
            head = electra.generator_head
            logits = torch.nn.functional.linear(head.transform(h), ours.bert.embeddings.word_embeddings.weight,
                                                head.bias)[selected]
            loss += float(torch.nn.functional.cross_entropy(logits, batch["mlm_labels"][selected], reduction="sum"))
            count += int(selected.sum())
        rows = np.unique(np.linspace(0, len(dataset) - 1, num=COS_ROWS).round().astype(np.int64))
        clean = CorruptionCollator(("original",), dataset.special_tokens, dataset.vocab_size, 0).collate(
            *dataset.take(rows), rows)
        cosine = mean_token_cosine(ours.bert(clean["input_ids"], clean["attention_mask"]).last_hidden,
                                   clean["attention_mask"].bool() & ~clean["special_mask"].bool())
    assert metrics["masked_tokens"] == count > 0
    assert metrics["mlm_loss"] == pytest.approx(loss / count, rel=1e-5)
    assert metrics["token_cosine"] == pytest.approx(cosine, abs=1e-5)
    without = convert(out, tmp_path / "hf_no_generator")
    with pytest.raises(ValueError, match="an ELECTRA discriminator without its generator"):
        heldout_metrics(without, tiny_shards_dir, top_token=top, max_sequences=SEQUENCES)


def test_an_electra_exports_generator_swapped_for_another_runs_is_refused(tiny_shards_dir, tmp_path):
    """The masked-LM numbers of an ELECTRA export are its `generator/`'s, and nothing in that directory names its
    run: another run's generator of the same preset (another seed) copied over it used to be evaluated as this
    run's. The conversion records the generator's fingerprint; the evaluation refuses a swapped or deleted
    `generator/` in one line naming it, and reads the untouched export as before."""
    import shutil

    exports = {}
    for seed in (1, 2):
        out = tmp_path / f"run{seed}"
        assert run_inprocess("tiny-electra", tiny_shards_dir, out, "optim.warmup_steps=0", "train.total_steps=2",
                             "train.checkpoint_every=2", f"train.seed={seed}") == 0
        exports[seed] = convert(out, tmp_path / f"hf{seed}", with_generator=True)
    top = top_token_of(tiny_shards_dir)
    assert heldout_metrics(exports[1], tiny_shards_dir, top_token=top, max_sequences=BATCH)["masked_tokens"] > 0
    shutil.rmtree(exports[1] / "generator")
    shutil.copytree(exports[2] / "generator", exports[1] / "generator")
    with pytest.raises(ValueError, match=r"^" + str(exports[1] / "generator") + ": its files are not the generator "
                       r"this model was converted with \(fingerprint [0-9a-f]{16} now, conversion.generator_fingerprint "
                       r"[0-9a-f]{16} in pipeline_meta.json\)"):
        heldout_metrics(exports[1], tiny_shards_dir, top_token=top, max_sequences=BATCH)
    shutil.rmtree(exports[1] / "generator")
    with pytest.raises(ValueError, match=r"generator: missing, but pipeline_meta.json records a generator"):
        heldout_metrics(exports[1], tiny_shards_dir, top_token=top, max_sequences=BATCH)
