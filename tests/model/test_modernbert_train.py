"""`model.arch=modernbert` through the real training entry point: every objective (and a combination)
trains a tiny ModernBERT with the same objective code as BERT, and a run resumes bitwise exactly."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.train.metrics import read_jsonl
from tests.train.runs import metric_rows, module_state, run_inprocess, tag_dir
from tests.train.test_resume_objectives import STEPS

ARCH = "model.arch=modernbert"
SHORT = ["train.total_steps=3", "train.checkpoint_every=3"]


@pytest.mark.parametrize("preset", ["tiny-mlm", "tiny-mlm-nce", "tiny-taco", "tiny-capt", "tiny-cocolm", "tiny-electra",
                                    "tiny-infoword"])
def test_every_objective_trains_a_modernbert(preset, tiny_shards_dir, tmp_path):
    assert run_inprocess(preset, tiny_shards_dir, tmp_path, ARCH, *SHORT) == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    state = module_state(tag_dir(tmp_path, 3))
    # the ModernBERT family's tensors, in the slots every objective reads (`bert.*`, `cls.*`) ...
    assert "bert.encoder.layers.1.attn.Wqkv.weight" in state and "bert.encoder.final_norm.weight" in state
    assert "bert.embeddings.tok_embeddings.weight" in state and "cls.predictions.transform.norm.weight" in state
    # ... and no BERT tensors: no biases in the layers, no position table
    assert not any("position_embeddings" in k or k.endswith("Wqkv.bias") for k in state)
    if preset == "tiny-cocolm":  # the generator is of the same family (GeGLU, final norm)
        assert "objectives.cocolm.generator.layers.0.mlp.Wi.weight" in state
        assert "objectives.cocolm.generator.final_norm.weight" in state
    if preset == "tiny-electra":  # a narrower generator of the same family, fed through ELECTRA's projection
        assert state["objectives.electra.generator.layers.0.mlp.Wi.weight"].shape[1] == 16  # a quarter of 64
        assert state["objectives.electra.embeddings_project.weight"].shape == (16, 64)


def test_taco_and_capt_combined_with_a_queue(tiny_shards_dir, tmp_path):
    extra = ["objectives={mlm: 1.0, taco: 1.0, capt: 1.0}", "objective_options.capt.queue_size=16"]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path, ARCH, *SHORT, *extra) == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    last = rows[-1]
    assert {"mlm/loss", "taco/loss", "capt/loss"} <= set(last)
    assert math.isclose(last["loss"], last["mlm/loss"] + last["taco/loss"] + last["capt/loss"], rel_tol=1e-5)
    assert last["capt/negatives"] > 3  # the queue holds the earlier steps' entries: more than in-batch


@pytest.mark.parametrize("preset", ["tiny-mlm", "tiny-mlm-nce", "tiny-taco", "tiny-capt", "tiny-cocolm", "tiny-electra",
                                    "tiny-infoword"])
def test_modernbert_resume_is_bitwise_exact(preset, tiny_shards_dir, tmp_path):
    """Checkpoint at step 2 of 4, resume in a fresh directory: steps 3-4 (every logged metric, CAPT's
    queue, COCO-LM's sampling, TACO's and NCE's negative draws, InfoWord's span masks and n-gram picks
    included) and the final weights equal the uninterrupted run's bit for bit."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert run_inprocess(preset, tiny_shards_dir, full, ARCH, *STEPS) == 0
    assert run_inprocess(preset, tiny_shards_dir, resumed, ARCH, *STEPS, f"train.resume={tag_dir(full, 2)}") == 0
    expected, got = metric_rows(full), metric_rows(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == expected[step], f"{preset}: step {step} differs after resume"
    assert expected[3]["loss"] != expected[4]["loss"]
    objective = preset.removeprefix("tiny-")
    if objective != "mlm":  # the objective's own loss is among the compared metrics, not only MLM's
        assert f"{objective}/loss" in expected[3] and f"{objective}/loss" in got[3]
    final_full, final_resumed = module_state(tag_dir(full, 4)), module_state(tag_dir(resumed, 4))
    assert final_full.keys() == final_resumed.keys()
    assert "bert.encoder.layers.0.attn.Wqkv.weight" in final_full
    for name, tensor in final_full.items():
        assert torch.equal(tensor, final_resumed[name]), f"{preset}: parameter {name} differs"


@pytest.fixture(scope="module")
def doc_shards_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Short documents, one per row (`--packing doc`): right-padded rows, so the unpadded path really runs."""
    from data_prep.build_shards import build_shards
    from tests.fixtures_data import TINY_SEQ_LEN, stdlib_documents, write_corpus

    lines = [line for doc in stdlib_documents() for line in doc.splitlines() if len(line.split()) > 3]
    documents = [" ".join(lines[i:i + 1 + i % 4]) for i in range(0, min(len(lines), 2000), 4)]  # 4 to 60 words
    corpus = write_corpus(tmp_path_factory.mktemp("doc_corpus") / "short_docs.txt", documents)
    out = tmp_path_factory.mktemp("doc_shards") / "doc"
    build_shards([corpus], tiny_tokenizer_dir, out, seq_len=TINY_SEQ_LEN, shard_size_mb=1, num_proc=1,
                 progress=False, packing="doc")
    return out


def test_unpadded_path_matches_masked_reference_in_training(doc_shards_dir, tmp_path):
    """Padded rows (document packing): TACO + MLM with `model.attention=varlen` (the layers run on the real
    tokens only, the window applied per sequence) and with the masked reference log the same losses."""
    from tests.fixtures_data import make_batch

    assert (make_batch(doc_shards_dir)["attention_mask"] == 0).any()  # the rows really are padded
    runs = {}
    for mode in ("varlen", "masked"):
        out = tmp_path / mode
        assert run_inprocess("tiny-taco", doc_shards_dir, out, ARCH, *SHORT, f"model.attention={mode}",
                             "model.dropout=0.0", "model.attention_dropout=0.0") == 0
        runs[mode] = read_jsonl(out / "metrics.jsonl")
    assert len(runs["varlen"]) == 3
    for a, b in zip(runs["varlen"], runs["masked"]):
        for key in ("loss", "mlm/loss", "taco/loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_long_context_preset_accepts_the_8192_token_shards_the_data_stage_builds(tmp_path, tiny_corpus_file,
                                                                              tiny_tokenizer_dir):
    """`modernbert-long`: `build_shards --seq-len 8192` writes rows the preset's model takes (max_position 8192,
    rotary: no position table to outgrow); the preset's plan checks pass against those shards."""
    from data_prep.build_shards import build_shards
    from pipeline.train.run_config import check_run, load_config
    from pipeline.model.modernbert import ModernBertConfig

    shards = tmp_path / "long"
    build_shards([tiny_corpus_file], tiny_tokenizer_dir, shards, seq_len=8192, shard_size_mb=1, num_proc=1,
                 progress=False)
    cfg = load_config("modernbert-long", [f"data.shards_dir={shards}", "deepspeed.precision=fp32",
                                          "data.global_batch_size=4", "data.micro_batch_size=1"])
    plan = check_run(cfg, world_size=1, cuda_available=False)
    assert plan.manifest.seq_len == 8192 and plan.manifest.total_sequences >= 5
    encoder = cfg.model.encoder_config(plan.manifest.vocab_size, plan.manifest.seq_len, plan.manifest.special_tokens)
    assert isinstance(encoder, ModernBertConfig) and encoder.max_position == 8192 and encoder.num_layers == 22
    with pytest.raises(Exception, match=r"model.max_position=1024 < shard seq_len=8192"):
        load_config("modernbert-long", [f"data.shards_dir={shards}", "model.max_position=1024"]).model.encoder_config(
            plan.manifest.vocab_size, 8192, plan.manifest.special_tokens)

