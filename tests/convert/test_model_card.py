"""The model card: every training fact a downstream team needs, Hub metadata, no local paths, and a
fine-tuning recommendation whose code runs."""
from __future__ import annotations

import yaml

from pipeline.export.health_check import HealthReport
from pipeline.export.hf_adapter import HFExport
from pipeline.export.model_card import SEGMENT_B_SNIPPET, CardInputs, public, render_model_card
from pipeline.model.encoder import build_encoder_config
from pipeline.train.run_meta import RunMeta


def _meta(**fields) -> RunMeta:
    encoder = build_encoder_config("tiny", vocab_size=800, max_position=64)
    config = {"name": "tiny-capt", "optim": {"name": "adamw", "lr": 5e-4, "betas": [0.9, 0.98], "weight_decay": 0.01,
                                            "warmup_steps": 7, "min_lr_ratio": 0.0},
              "data": {"global_batch_size": 16, "micro_batch_size": 4}, "train": {"total_steps": 30, "seed": 5},
              "deepspeed": {"precision": "bf16"}}
    values = dict(
        encoder_config=encoder.to_dict(), objectives={"mlm": 1.0, "capt": 0.5}, objective_options={},
        special_tokens={"pad": 0}, tokenizer_dir="/home/someone/secret/tok", data_dir="/home/someone/secret/shards",
        manifest_hash="f" * 64, config_hash="c" * 64, config=config, step=30, consumed_samples=480,
        tokens_seen=29123, zero_stage=2, world_size=4, last_metrics={"capt/loss": 1.23456, "mlm/loss": 4.5},
        corpus={"files": [{"name": "wiki.txt", "sha256": "a" * 64, "documents": 12}], "seq_len": 64,
                "sequences": 900, "tokens": 55000, "packing": "full"},
        recipe={"preset": "tiny-capt", "overrides": {
            "optim.lr": {"preset": 1e-3, "run": 5e-4},
            "data.shards_dir": {"preset": "", "run": "/home/someone/secret/shards"}}})
    values.update(fields)
    return RunMeta(**values)


def _card(meta: RunMeta, **inputs) -> str:
    export = HFExport(main={}, generator=None, objective_heads={})
    return render_model_card(meta, export, CardInputs("step_00000030", "fp32 master weights", **inputs), False)


def _front(card: str) -> dict:
    return yaml.safe_load(card.split("---")[1])


def test_card_states_the_training_facts_without_local_paths():
    card = _card(_meta(), health=HealthReport(0.31, 16, 700, {"capt/positive_cosine": 0.82}))
    for expected in ("| recipe | `tiny-capt` |", "`optim.lr`: 0.001 -> 0.0005", "`data.shards_dir`: `` -> `shards`",
                     "| learning rate | 0.0005 peak", "| warm-up | 7 steps |",
                     "| batch | 16 sequences per optimizer step (4 per micro-batch, 4 ranks) |",
                     "| sequence length | 64 tokens |", "| optimizer steps | 30 (of `train.total_steps` 30) |",
                     "| tokens seen | 29123 |", "`wiki.txt` (12 documents", "bf16 / 2 / 4", "`step_00000030`",
                     "| capt/loss | 1.2346 |", "| `capt/positive_cosine` (last logged step) | 0.8200 | ok",
                     "| 0.3100 | ok (collapsed above 0.9) |", "none: random initialisation (seed 5)"):
        assert expected in card, expected
    assert "/home/someone" not in card and "secret" not in card
    front = _front(card)
    assert front["license"] == "unknown" and "base_model" not in front and "capt" in front["tags"]
    assert "Warning" not in card


def test_license_and_base_model_metadata():
    base = {"name": "bert-base-uncased", "config_sha256": "b" * 64, "license": "apache-2.0"}
    card = _card(_meta(base_model=base))
    front = _front(card)
    assert front["license"] == "apache-2.0" and front["base_model"] == "bert-base-uncased"
    assert "`bert-base-uncased` (config.json sha256 `bbbbbbbbbbbbbbbb`), warm start" in card
    assert "the base model's card" in card and "nor carried over from the base model" in card
    front = _front(_card(_meta(base_model=base), license="mit", base_model="google-bert/bert-base-uncased"))
    assert front["license"] == "mit" and front["base_model"] == "google-bert/bert-base-uncased"


def test_collapse_is_at_the_top_of_the_card():
    card = _card(_meta(last_metrics={"capt/positive_cosine": 1.0}), health=HealthReport(0.97, 16, 700,
                                                                                        {"capt/positive_cosine": 1.0}))
    top = card.split("## Training")[0]
    assert "**Warning: this checkpoint looks collapsed**" in top
    assert "mean token cosine 0.9700 > 0.9" in top and "capt/positive_cosine = 1.0000" in top


def test_unrecorded_recipe_and_unmeasured_health_say_so():
    card = _card(_meta(recipe={}), health=HealthReport(None, note="shards not found at shards: pass --shards DIR"))
    assert "(not recorded: the run was not started from the command line)" in card
    assert "| not measured | shards not found at shards: pass --shards DIR |" in card


def test_public_keeps_names_only():
    assert public({"a": "/x/y/z.txt", "b": ["rel/dir/", 3, "plain"]}) == {"a": "z.txt", "b": ["dir", 3, "plain"]}


def test_the_segment_b_recommendation_runs(bert_dir):
    """The card's snippet, run on a BERT directory: segment B then starts from segment A."""
    scope: dict = {}
    exec(SEGMENT_B_SNIPPET.replace("path/to/this/directory", str(bert_dir)), scope)
    types = scope["model"].bert.embeddings.token_type_embeddings.weight
    assert types.shape[0] == 2 and bool((types[1] == types[0]).all())


def test_card_says_what_the_mlm_head_computes_when_nce_trained_it():
    from pipeline.export.hf_adapter import HeadBiasCorrection

    meta = _meta(objectives={"mlm-nce": 1.0})
    inputs = CardInputs("step_00000030", "fp32 master weights")
    fixed = HeadBiasCorrection(True, "the MLM head was trained with sampled negatives (mlm-nce; ...)",
                               {"mlm-nce": "sampled_softmax"}, ["objectives.mlm-nce.sampler.log_proposal"])
    card = render_model_card(meta, HFExport({}, None, {}, head_bias=fixed), inputs, False)
    section = card.split("## Masked-LM head")[1].split("##")[0]
    assert "The MLM head was trained with sampled negatives (mlm-nce" in section
    assert "p(v | c) ∝ q(v) exp s(v, c), i.e. cls.predictions.bias = trained bias + log q(v)" in section
    kept = HeadBiasCorrection(False, "the MLM head was trained by a full softmax (mlm) and ...", {"mlm": "full_softmax"})
    card = render_model_card(meta, HFExport({}, None, {}, head_bias=kept), inputs, False)
    assert "The MLM head was trained by a full softmax (mlm)" in card and "Formula" not in card
    assert "## Masked-LM head" not in _card(_meta())  # no NCE objective: nothing to say


def test_health_section_lists_the_learning_signals_against_their_chance_levels():
    from pipeline.monitor.signals import learning_signals

    last = {"taco/loss": 0.5, "taco/loss_chance": 2.1972, "mlm/accuracy": 0.06, "health/unigram_accuracy": 0.057,
            "health/token_cosine": 0.2}
    card = _card(_meta(last_metrics=last), health=HealthReport(0.31, 16, 700, signals=learning_signals(last)))
    section = card.split("## Health check (at conversion)")[1]
    assert "| `taco/loss` | 0.5000 | 0.23x chance `taco/loss_chance` (2.1972) | learned |" in section
    assert "| `mlm/accuracy` | 0.0600 | +0.0030 vs unigram plateau `health/unigram_accuracy` (0.0570) | **AT CHANCE** |" \
        in section
    assert "`health/token_cosine`" not in section  # the collapse row above already says it
    assert "Learning signals" not in _card(_meta(), health=HealthReport(0.31, 16, 700))  # none: no subsection


def test_small_final_metrics_are_not_printed_as_zero():
    """Issue 49: the final learning rate at the end of its decay (1.1e-06) was printed `0.0000`."""
    card = _card(_meta(last_metrics={"lr": 1.1e-06, "capt/loss": 1.23456, "grad_norm": 0.0, "step": 30}))
    assert "| lr | 1.1e-06 |" in card and "| capt/loss | 1.2346 |" in card
    assert "| grad_norm | 0.0000 |" in card and "| step | 30 |" in card


def test_the_card_names_the_schedule_the_run_used():
    meta = _meta()
    meta.config["optim"].update(schedule="wsd", decay_shape="1-sqrt", decay_steps=0, decay_fraction=0.2)
    assert ("linear warm-up, stable at the peak, then a 1-sqrt decay over the last 20% of the steps to 0.0 x peak"
            in _card(meta))
    meta.config["optim"].update(schedule="cosine")
    assert "linear warm-up then cosine decay to 0.0 x peak" in _card(meta)
    assert "linear warm-up then linear decay to 0.0 x peak" in _card(_meta())
