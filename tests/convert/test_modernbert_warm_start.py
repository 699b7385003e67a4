"""`model.init_from` with a Hugging Face ModernBERT directory (`model.arch=modernbert`): the warm-started
model computes the Hugging Face model's logits, a real run's step-1 loss is HF's loss, and a tiny learning
rate exports the input weights, TACO and CAPT continue pretraining it; a directory of the other family is refused
with the fix named."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import load_config
from pipeline.export.convert import convert
from pipeline.train.metrics import read_jsonl
from tests.fixtures_data import make_batch
from tests.train.runs import run_inprocess

ARCH = "model.arch=modernbert"
ONE_STEP = ["optim.warmup_steps=0", "train.total_steps=1"]
#: Not the tiny preset's shape (so the shape really comes from config.json): 4 layers, global every 2.
TINY_MODERNBERT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=80,
                       max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2,
                       global_rope_theta=1000.0, local_rope_theta=100.0)


def save_tiny_modernbert(directory: Path, tokenizer_dir: Path, seed: int = 11, **config) -> Path:
    """A random `ModernBertForMaskedLM` (every tensor perturbed off its init constants) + tokenizer."""
    from transformers import AutoTokenizer, ModernBertConfig, ModernBertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = ModernBertConfig(**{**TINY_MODERNBERT, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                              "cls_token_id": tokenizer.cls_token_id, "sep_token_id": tokenizer.sep_token_id,
                              "bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id, **config})
    torch.manual_seed(seed)
    model = ModernBertForMaskedLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def modernbert_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return save_tiny_modernbert(tmp_path_factory.mktemp("hf_mb") / "tiny-modernbert", tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def modernbert_shards(tmp_path_factory, tiny_corpus_file, modernbert_dir) -> Path:
    from data_prep.build_shards import build_shards
    from tests.fixtures_data import TINY_SEQ_LEN, TINY_SHARD_MB

    out = tmp_path_factory.mktemp("mb_shards") / "shards"
    build_shards([tiny_corpus_file], modernbert_dir, out, seq_len=TINY_SEQ_LEN, shard_size_mb=TINY_SHARD_MB,
                 num_proc=1, progress=False)
    return out


def test_warm_started_model_computes_the_hugging_face_logits(modernbert_dir, modernbert_shards):
    from transformers import ModernBertForMaskedLM

    from pipeline.data.shards import read_manifest
    from pipeline.pretrain.build import build_pretrain_model
    from pipeline.model.config import ModelConfig

    manifest = read_manifest(modernbert_shards)
    model_cfg = ModelConfig(arch="modernbert", init_from=str(modernbert_dir), dropout=0.0, attention_dropout=0.0)
    model_cfg.check()
    encoder = model_cfg.encoder_config(manifest.vocab_size, manifest.seq_len, manifest.special_tokens)
    assert (encoder.num_layers, encoder.num_heads, encoder.ffn_size) == (4, 4, 80)  # from config.json, not the preset
    assert (encoder.global_attn_every_n_layers, encoder.local_attention, encoder.local_rope_theta) == (2, 8, 100.0)
    model_cfg.check_init_from(manifest, str(modernbert_shards), fresh_start=True)
    ours = build_pretrain_model(encoder, {"mlm": 1.0}, manifest.special_tokens, {}, init_from=str(modernbert_dir)).eval()
    hf = ModernBertForMaskedLM.from_pretrained(str(modernbert_dir), attn_implementation="sdpa").eval()

    batch = make_batch(modernbert_shards, ("masked",), batch_size=4)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    mask[1, 30:] = 0  # one padded row
    ids[1, 30:] = manifest.special_tokens["pad"]
    with torch.no_grad():
        reference = hf(input_ids=ids, attention_mask=mask).logits
        for mode in ("masked", "varlen"):
            ours.bert.encoder.attention = mode
            logits = ours.cls(ours.bert(ids, mask, seqlens=mask.sum(1)).last_hidden)
            torch.testing.assert_close(logits[mask.bool()], reference[mask.bool()], rtol=0, atol=1e-4, msg=mode)


def test_step_one_loss_is_hugging_face_loss_and_tiny_lr_exports_the_input(modernbert_dir, modernbert_shards, tmp_path):
    from transformers import ModernBertForMaskedLM

    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", modernbert_shards, out, ARCH, f"model.init_from={modernbert_dir}", *ONE_STEP,
                         "optim.lr=1e-9", "model.dropout=0", "model.attention_dropout=0", "data.micro_batch_size=8") == 0
    ours = read_jsonl(out / "metrics.jsonl")[0]
    seed = load_config("tiny-mlm").train.seed
    batch = make_batch(modernbert_shards, ("masked",), batch_size=8, seed=seed)
    hf = ModernBertForMaskedLM.from_pretrained(str(modernbert_dir)).eval()
    with torch.no_grad():
        loss = hf(input_ids=batch["masked_ids"], attention_mask=batch["attention_mask"], labels=batch["mlm_labels"]).loss
    assert ours["mlm/loss"] == pytest.approx(float(loss), rel=1e-5)

    exported = convert(out, tmp_path / "hf")
    before, after = load_file(modernbert_dir / "model.safetensors"), load_file(exported / "model.safetensors")
    assert set(after) == set(before) - {"decoder.weight"}
    for key in after:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=1e-6, msg=key)
    meta = json.loads((exported / "pipeline_meta.json").read_text())
    assert meta["base_model"]["name"] == "tiny-modernbert"
    assert "\nbase_model: tiny-modernbert\n" in (exported / "README.md").read_text().split("---")[1]


@pytest.mark.parametrize("preset, metric", [("tiny-taco", "taco/loss"), ("tiny-capt", "capt/negatives")])
def test_taco_and_capt_continue_pretraining_a_hugging_face_modernbert(preset, metric, modernbert_dir,
                                                                      modernbert_shards, tmp_path):
    """The issue's use case: continue pretraining a Hugging Face ModernBERT with TACO or CAPT (beside MLM).
    Two steps at the preset's learning rate: the objective trains (finite losses, its own metrics) and the
    encoder and MLM head start from the directory's weights: each checked tensor ends within two Adam steps
    (at most about 1.4 lr each) of its Hugging Face value, which no fresh initialisation comes near (`save_tiny_modernbert`
    moved every tensor by 0.05 * randn off its init); the continued run converts, naming its base model."""
    from tests.train.runs import module_state, tag_dir

    hf = load_file(modernbert_dir / "model.safetensors")
    pairs = {"bert.embeddings.tok_embeddings.weight": "model.embeddings.tok_embeddings.weight",
             "bert.encoder.layers.3.attn.Wqkv.weight": "model.layers.3.attn.Wqkv.weight",
             "bert.encoder.layers.2.mlp.Wi.weight": "model.layers.2.mlp.Wi.weight",
             "bert.encoder.final_norm.weight": "model.final_norm.weight",
             "cls.predictions.transform.norm.weight": "head.norm.weight"}
    out = tmp_path / "run"
    assert run_inprocess(preset, modernbert_shards, out, ARCH, f"model.init_from={modernbert_dir}",
                         "optim.warmup_steps=0", "train.total_steps=2", "train.checkpoint_every=2") == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r[metric] > 0 for r in rows)
    assert rows[1]["lr"] > 1e-4  # a real learning rate: the closeness below is not a frozen model's

    trained = module_state(tag_dir(out, 2))
    for ours, theirs in pairs.items():
        assert trained[ours].shape == hf[theirs].shape, ours
        moved = float((trained[ours] - hf[theirs]).abs().max())
        assert 0 < moved < 4e-3, (ours, moved)
    exported = convert(out, tmp_path / "hf")
    assert json.loads((exported / "pipeline_meta.json").read_text())["base_model"]["name"] == "tiny-modernbert"


def test_family_mismatch_and_unsupported_fields_are_named(modernbert_dir, bert_dir, modernbert_shards, tmp_path):
    from pipeline.model.config import ModelConfig

    with pytest.raises(ConfigError, match=r"model_type='modernbert'; model.init_from takes BERT checkpoints.*set model.arch=modernbert"):
        ModelConfig(init_from=str(modernbert_dir)).encoder_config(100, 64, {"pad": 0})
    with pytest.raises(ConfigError, match=r"model_type='bert'; model.init_from takes ModernBERT checkpoints.*set model.arch=bert"):
        ModelConfig(arch="modernbert", init_from=str(bert_dir)).encoder_config(100, 64, {"pad": 0})
    silu = save_tiny_modernbert(tmp_path / "silu", modernbert_dir, hidden_activation="silu")
    with pytest.raises(ConfigError, match=r"silu/config.json: hidden_activation='silu' is not supported"):
        ModelConfig(arch="modernbert", init_from=str(silu)).encoder_config(100, 64, {"pad": 0})
    config = json.loads((silu / "config.json").read_text())
    config.update(hidden_activation="gelu", layer_types=["full_attention", "full_attention", "sliding_attention",
                                                         "full_attention"])
    (silu / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"layer_types .* is not 'full_attention every n layers"):
        ModelConfig(arch="modernbert", init_from=str(silu)).encoder_config(100, 64, {"pad": 0})
    with pytest.raises(ConfigError, match=r"model.num_layers=3 disagrees with num_hidden_layers=4"):
        ModelConfig(arch="modernbert", init_from=str(modernbert_dir), num_layers=3).encoder_config(100, 64, {"pad": 0})


def test_legacy_config_json_fields_are_read():
    """config.json files written by transformers 4.x (the Hub's ModernBERT-base) spell the layer pattern and
    rotary bases as `global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`."""
    from pipeline.model.hf_names import modernbert_fields_from_hf

    legacy = {"model_type": "modernbert", "vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152,
              "num_hidden_layers": 22, "num_attention_heads": 12, "max_position_embeddings": 8192, "norm_eps": 1e-5,
              "global_attn_every_n_layers": 3, "local_attention": 128, "global_rope_theta": 160000.0,
              "local_rope_theta": 10000.0, "hidden_activation": "gelu", "decoder_bias": True, "norm_bias": False}
    fields = modernbert_fields_from_hf(legacy, "config.json")
    assert fields["global_attn_every_n_layers"] == 3 and fields["local_attention"] == 128
    assert (fields["global_rope_theta"], fields["local_rope_theta"]) == (160000.0, 10000.0)
    assert (fields["num_layers"], fields["ffn_size"], fields["max_position"]) == (22, 1152, 8192)
    with pytest.raises(ValueError, match=r"config.json: decoder_bias=False is not supported"):
        modernbert_fields_from_hf({**legacy, "decoder_bias": False}, "config.json")
    with pytest.raises(ValueError, match=r"rope_parameters.full_attention=.*RoPE scaling"):
        modernbert_fields_from_hf({**legacy, "rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "config.json")
