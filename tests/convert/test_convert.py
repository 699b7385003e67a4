"""Conversion is exact: HF logits equal the restored training model's own forward, for every
objective, ZeRO stage 1/2/3 with two ranks, and one rank (plus log q where only NCE objectives
trained the MLM head: the export is then the masked LM their scores imply)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.data.reader import ShardDataset
from pipeline.monitor.health import unigram_counts
from pipeline.export.convert import consolidate_fp32_weights
from pipeline.export.objective_heads import load_objective_heads
from pipeline.pretrain.build import unigram_bias
from tests.convert.conftest import RUNS

pytestmark = pytest.mark.slow


def _mlm_logits(model_dir, reference) -> torch.Tensor:
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    assert type(model).__name__ == "BertForMaskedLM"
    with torch.no_grad():
        return model(input_ids=reference["input_ids"], attention_mask=reference["attention_mask"]).logits


#: Runs whose MLM head only sampled-softmax objectives trained: the export's logits are the training
#: head's scores + log q (the masked LM p(v | c) ∝ q(v) exp s(v, c)); the other runs' are the scores.
NCE_ONLY_HEAD = {"zero3-1rank-mlmnce"}


@pytest.mark.parametrize("name", list(RUNS))
def test_masked_lm_logits_match_training_model(name, trained_runs, converted):
    run, out = trained_runs(name), converted(name)
    logits = _mlm_logits(out, run.reference)
    expected = run.reference["logits"]
    if name in NCE_ONLY_HEAD:
        (log_q,) = run.reference["log_proposals"].values()
        assert log_q.std() > 1.0  # a real correction, restored from the checkpoint by the resume path
        expected = expected + log_q
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # The comparison has teeth: the logits are not trivially small and vary by position.
    assert run.reference["logits"].std() > 1e-2

    meta = json.loads((run.tag_dir / "pipeline_meta.json").read_text())
    config = json.loads((out / "config.json").read_text())
    enc = meta["encoder_config"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        enc["num_layers"], enc["hidden_size"], enc["ffn_size"])
    assert config["hidden_act"] == "gelu" and config["vocab_size"] == enc["vocab_size"]
    assert meta["zero_stage"] == run.spec.zero_stage and meta["world_size"] == run.spec.ranks
    source = "consolidated from the ZeRO partitions" if run.spec.zero_stage else "(non-ZeRO) model file"
    assert source in (out / "README.md").read_text()


@pytest.mark.parametrize("name", list(RUNS))
def test_objective_heads_file_holds_exactly_the_objective_parameters(name, trained_runs, converted):
    run, out = trained_runs(name), converted(name)
    params = run.reference["objective_params"]
    generator_prefixes = ("objectives.cocolm.generator.", "objectives.cocolm.generator_head.")
    expected = {k: v for k, v in params.items() if not k.startswith(generator_prefixes)}
    path = out / "objective_heads.safetensors"
    if not expected:
        assert not path.exists()
        return
    heads = load_file(path)
    assert sorted(heads) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(heads[key], value, rtol=0, atol=0)
    # the documented loader rebuilds every head as a module holding exactly the trained tensors
    modules = load_objective_heads(out)
    rebuilt = {f"objectives.{name}.{k}": v for name, m in modules.items() for k, v in m.state_dict().items()}
    assert sorted(rebuilt) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(rebuilt[key], value, rtol=0, atol=0)


def test_cocolm_generator_is_a_second_masked_lm(trained_runs, converted):
    name = "zero3-2ranks-cocolm"
    run, out = trained_runs(name), converted(name)
    logits = _mlm_logits(out / "generator", run.reference)
    torch.testing.assert_close(logits, run.reference["generator_logits"], rtol=1e-5, atol=1e-5)
    gen_config = json.loads((out / "generator" / "config.json").read_text())
    assert gen_config["num_hidden_layers"] == 1  # tiny-cocolm: generator_layers 1
    main = load_file(out / "model.safetensors")
    gen = load_file(out / "generator" / "model.safetensors")
    for key in ("bert.embeddings.word_embeddings.weight", "bert.embeddings.LayerNorm.weight"):
        torch.testing.assert_close(gen[key], main[key], rtol=0, atol=0)  # shared embeddings
    assert not torch.equal(gen["cls.predictions.bias"], main["cls.predictions.bias"])  # its own head


def test_model_card_describes_the_run(trained_runs, converted):
    name = "zero1-2ranks-mlm-taco-infoword"
    run, out = trained_runs(name), converted(name)
    meta = json.loads((run.tag_dir / "pipeline_meta.json").read_text())
    card = (out / "README.md").read_text()
    assert meta["step"] == 3 and meta["tokens_seen"] > 0
    for expected in ("`taco` (weight 1)", "`infoword`", "| recipe | `tiny-taco` |", "| optimizer steps | 3 (of",
                     "`train.total_steps`: 20 -> 3", f"| tokens seen | {meta['tokens_seen']} |",
                     meta["manifest_hash"], "ZeRO stage / ranks | fp32 / 1 / 2", "`stdlib_docs.txt`",
                     f"{meta['last_metrics']['taco/loss']:.4f}", "consolidated from the ZeRO partitions"):
        assert expected in card, expected
    exported = json.loads((out / "pipeline_meta.json").read_text())
    assert exported["step"] == meta["step"] and exported["manifest_hash"] == meta["manifest_hash"]
    assert Path(meta["data_dir"]).is_absolute() and exported["data_dir"] == Path(meta["data_dir"]).name
    assert "/" not in json.dumps({k: exported[k] for k in ("tokenizer_dir", "data_dir", "config")})


def _head_bias_record(out: Path) -> dict:
    return json.loads((out / "pipeline_meta.json").read_text())["conversion"]["mlm_head_bias"]


def test_an_nce_only_head_bias_is_corrected_by_the_checkpoints_log_q(trained_runs, converted, tiny_shards_dir):
    """ZeRO-3 (the buffer comes from the rank files through DeepSpeed's consolidation): the exported
    bias is exactly the trained bias + log q, and log q is the shards' unigram_bias, as trained."""
    name = "zero3-1rank-mlmnce"
    run, out = trained_runs(name), converted(name)
    key = "objectives.mlm-nce.sampler.log_proposal"
    state, _ = consolidate_fp32_weights(run.tag_dir)
    assert torch.equal(state[key], unigram_bias(unigram_counts(ShardDataset(tiny_shards_dir))))
    assert torch.equal(run.reference["log_proposals"][key], state[key])  # what a resume restores
    exported = load_file(out / "model.safetensors")["cls.predictions.bias"]
    assert torch.equal(exported, state["cls.predictions.decoder.bias"] + state[key])
    torch.testing.assert_close(state["cls.predictions.decoder.bias"], run.reference["head_bias"], rtol=0, atol=1e-6)
    record = _head_bias_record(out)
    assert record["corrected"] and record["objectives"] == {"mlm-nce": "sampled_softmax"}
    assert record["log_proposal_buffers"] == [key] and "exp s(v, c)" in record["formula"]
    card = (out / "README.md").read_text()
    assert "## Masked-LM head" in card and "its bias is corrected by log q" in card
    assert key not in card  # folded into the bias, not listed as a dropped buffer


def test_a_head_shared_with_a_full_softmax_is_exported_as_trained(trained_runs, converted):
    name = "zero2-2ranks-mlm-capt-mlmnce"
    run, out = trained_runs(name), converted(name)
    state, _ = consolidate_fp32_weights(run.tag_dir)
    assert state["objectives.mlm-nce.sampler.log_proposal"].std() > 1.0  # there was a log q to add
    assert torch.equal(load_file(out / "model.safetensors")["cls.predictions.bias"], state["cls.predictions.decoder.bias"])
    record = _head_bias_record(out)
    assert not record["corrected"] and "full softmax (mlm)" in record["note"]
    assert "full softmax (mlm) and with sampled negatives (mlm-nce)" in (out / "README.md").read_text()


def test_the_command_states_the_head_bias_decision(trained_runs, tmp_path, capsys):
    """The printed summary carries `mlm_head_bias`; an uncorrected NCE head is also a note on stderr."""
    from pipeline.export.convert import main as convert_main

    assert convert_main([str(trained_runs("zero2-2ranks-mlm-capt-mlmnce").checkpoints), str(tmp_path / "hf"),
                         "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["mlm_head_bias"]["corrected"] is False and "model.safetensors" in summary["files"]
    assert "note: the MLM head was trained by a full softmax (mlm)" in captured.err
    assert convert_main([str(trained_runs("zero3-1rank-mlmnce").checkpoints), str(tmp_path / "hf3"), "--json"]) == 0
    captured = capsys.readouterr()
    corrected = json.loads(captured.out.strip().splitlines()[-1])["mlm_head_bias"]
    assert corrected["corrected"] is True
    assert "note:" not in captured.err
    # for a person (no --json): the same decision, one line
    assert convert_main([str(trained_runs("zero3-1rank-mlmnce").checkpoints), str(tmp_path / "hf4")]) == 0
    assert f"  MLM head bias: {corrected['note']}" in capsys.readouterr().out.splitlines()
