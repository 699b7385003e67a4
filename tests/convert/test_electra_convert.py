"""An ELECTRA run converts as the ecosystem expects an ELECTRA: the discriminator is a plain
`ElectraForPreTraining` whose logits (and `AutoModel` states) equal the training model's within 1e-4, with
its tokenizer, model card and sentence-transformers files; `--with-generator` writes the generator as an
`ElectraForMaskedLM` with the training generator's logits. A ModernBERT-family ELECTRA exports its body as
a `ModernBertModel` and refuses `--with-generator` by name; an MLM head trained beside ELECTRA is refused."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pipeline.export.convert import convert
from pipeline.model.hf_names import ExportError
from pipeline.pretrain.build import model_from_meta
from pipeline.train.run_config import unconvertible_warning
from pipeline.train.run_meta import RunMeta
from tests.train.runs import module_state, run_inprocess, tag_dir

SHORT = ["train.total_steps=3", "train.checkpoint_every=3"]


@pytest.fixture(scope="module")
def electra_run(tmp_path_factory, tiny_shards_dir) -> Path:
    """`tiny-electra` for 3 steps (dropout on, so the weights move from their initial values)."""
    out = tmp_path_factory.mktemp("electra_run") / "run"
    previous = torch.get_num_threads()
    assert run_inprocess("tiny-electra", tiny_shards_dir, out, *SHORT) == 0
    torch.set_num_threads(previous)
    return out


@pytest.fixture(scope="module")
def electra_export(electra_run, tmp_path_factory) -> Path:
    return convert(electra_run, tmp_path_factory.mktemp("electra_hf") / "hf", with_generator=True)


def _ours(run: Path):
    tag = tag_dir(run, 3)
    model = model_from_meta(RunMeta.read(tag))
    model.load_state_dict(module_state(tag), strict=False)
    return model.eval()


def _probe(vocab: int, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 40), generator=gen)
    lengths = torch.tensor([40, 27, 9])
    mask = (torch.arange(40)[None] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad), mask, lengths


def test_discriminator_is_electra_for_pretraining_with_the_training_logits(electra_run, electra_export):
    from transformers import AutoConfig, AutoModel, ElectraForPreTraining, ElectraModel

    config = json.loads((electra_export / "config.json").read_text())
    assert config["model_type"] == "electra" and config["architectures"] == ["ElectraForPreTraining"]
    assert config["embedding_size"] == config["hidden_size"] == 64
    hf, info = ElectraForPreTraining.from_pretrained(str(electra_export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # every tensor is there, nothing else
    hf.eval()
    ours = _ours(electra_run)
    head = ours.objectives["electra"].discriminator_predictions
    ids, mask, lengths = _probe(config["vocab_size"], config["pad_token_id"])
    real = mask.bool()
    with torch.no_grad():
        reference = hf(input_ids=ids, attention_mask=mask).logits
        for mode, seqlens in (("masked", None), ("varlen", lengths)):
            ours.bert.encoder.attention = mode
            logits = head(ours.bert(ids, mask, seqlens=seqlens).last_hidden)
            torch.testing.assert_close(logits[real], reference[real], rtol=0, atol=1e-4, msg=mode)
        body = AutoModel.from_pretrained(str(electra_export)).eval()  # what sentence-transformers loads
        assert type(body) is ElectraModel and type(AutoConfig.from_pretrained(str(electra_export))).__name__ == "ElectraConfig"
        torch.testing.assert_close(body(input_ids=ids, attention_mask=mask).last_hidden_state[real],
                                   ours.bert(ids, mask).last_hidden[real], rtol=0, atol=1e-4)
    assert reference[real].std() > 1e-3  # the comparison is not between two constant tensors


def test_generator_is_electra_for_masked_lm_with_the_training_logits(electra_run, electra_export):
    from transformers import AutoModelForMaskedLM, ElectraForMaskedLM

    gen_dir = electra_export / "generator"
    config = json.loads((gen_dir / "config.json").read_text())
    assert config["architectures"] == ["ElectraForMaskedLM"]
    assert (config["embedding_size"], config["hidden_size"], config["num_attention_heads"],
            config["intermediate_size"], config["num_hidden_layers"]) == (64, 16, 1, 32, 2)  # 1/4 wide, full depth
    generator = AutoModelForMaskedLM.from_pretrained(str(gen_dir)).eval()
    assert type(generator) is ElectraForMaskedLM
    assert generator.generator_lm_head.weight.data_ptr() == generator.electra.embeddings.word_embeddings.weight.data_ptr()
    ours = _ours(electra_run)
    objective = ours.objectives["electra"]
    ids, mask, _ = _probe(config["vocab_size"], config["pad_token_id"])
    real = mask.bool()
    with torch.no_grad():
        h = objective.generator(objective.embeddings_project(ours.bert.embeddings(ids)), mask)
        head = objective.generator_head
        logits = F.linear(head.transform(h), ours.bert.embeddings.word_embeddings.weight, head.bias)
        torch.testing.assert_close(logits[real], generator(input_ids=ids, attention_mask=mask).logits[real],
                                   rtol=0, atol=1e-4)
    assert "# ELECTRA generator" in (gen_dir / "README.md").read_text()


def test_export_files_card_and_sentence_transformers(electra_run, electra_export):
    exported = load_file(electra_export / "model.safetensors")
    trained = module_state(tag_dir(electra_run, 3))
    assert torch.equal(exported["discriminator_predictions.dense_prediction.weight"],
                       trained["objectives.electra.discriminator_predictions.dense_prediction.weight"])
    assert not any(k.startswith(("cls.", "bert.", "objectives.")) for k in exported)  # the untrained MLM head left out
    assert not (electra_export / "objective_heads.safetensors").exists()  # every ELECTRA tensor is in a HF model
    for name in ("tokenizer.json", "tokenizer_config.json", "modules.json", "0_Transformer/sentence_bert_config.json",
                 "0_Transformer/model.safetensors", "1_Pooling/config.json"):
        assert (electra_export / name).is_file(), name
    # the sentence-transformers module is the discriminator's body alone (ElectraModel), so its load is clean
    assert json.loads((electra_export / "0_Transformer/config.json").read_text())["architectures"] == ["ElectraModel"]
    card = (electra_export / "README.md").read_text()
    assert "pipeline_tag: feature-extraction" in card and "- electra" in card
    assert "ElectraForPreTraining" in card and "model.electra.embeddings.token_type_embeddings" in card
    assert "BertForMaskedLM" not in card


def test_sentence_transformers_reads_the_export(electra_export):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(electra_export), device="cpu")
    embeddings = model.encode(["the first sentence", "and a second one"])
    assert embeddings.shape == (2, 64)


def test_an_mlm_head_trained_beside_electra_is_refused(tiny_shards_dir, tmp_path, caplog):
    """The combination trains (a valid multi-task run) but converts to nothing: training says so at its start,
    before compute, and `cpt-convert` refuses it in one line."""
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="pipeline.train.run_config"):
        assert run_inprocess("tiny-electra", tiny_shards_dir, out, *SHORT, "objectives={electra: 1.0, mlm: 1.0}") == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "pipeline.train.run_config"]
    assert len(warned) == 1 and warned[0].startswith("objectives: electra with ['mlm'], which train the MLM head")
    assert "cpt-convert will refuse this run's checkpoints" in warned[0]
    assert unconvertible_warning({"electra": 1.0}) is None and unconvertible_warning({"electra": 1.0, "taco": 1.0}) is None
    assert unconvertible_warning({"electra": 1.0, "mlm": 0.0}) is None  # a zero weight trains nothing
    with pytest.raises(ExportError, match=r"\['mlm'\] train the MLM head cls.predictions beside electra"):
        convert(out, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_modernbert_electra_exports_its_body_and_refuses_the_generator(tiny_shards_dir, tmp_path):
    from transformers import AutoModel, ModernBertModel

    out = tmp_path / "run"
    assert run_inprocess("tiny-electra", tiny_shards_dir, out, *SHORT, "model.arch=modernbert") == 0
    with pytest.raises(ExportError, match="--with-generator: the ELECTRA generator of a model.arch=modernbert run"):
        convert(out, tmp_path / "refused", with_generator=True)
    assert not (tmp_path / "refused").exists()
    exported = convert(out, tmp_path / "hf")
    body = AutoModel.from_pretrained(str(exported)).eval()
    assert type(body) is ModernBertModel
    heads = load_file(exported / "objective_heads.safetensors")
    assert any(k.startswith("objectives.electra.discriminator_predictions.") for k in heads)
    assert any(k.startswith("objectives.electra.generator.") for k in heads)
    ours = _ours(out)
    ids, mask, _ = _probe(body.config.vocab_size, body.config.pad_token_id)
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(body(input_ids=ids, attention_mask=mask).last_hidden_state[real],
                                   ours.bert(ids, mask).last_hidden[real], rtol=0, atol=1e-4)


def test_factorised_embeddings_export_with_their_projections(tiny_shards_dir, tmp_path):
    """`model.embedding_size=24` under the hidden 64 (ELECTRA-Small's shape): `ElectraConfig.embedding_size` is 24
    for the discriminator and the generator, the projections are `electra.embeddings_project` (24 -> 64 and
    24 -> 16), and both loaded models give the training model's logits within 1e-4."""
    from transformers import ElectraForMaskedLM, ElectraForPreTraining

    out = tmp_path / "run"
    assert run_inprocess("tiny-electra", tiny_shards_dir, out, *SHORT, "model.embedding_size=24") == 0
    exported = convert(out, tmp_path / "hf", with_generator=True)
    config = json.loads((exported / "config.json").read_text())
    assert (config["embedding_size"], config["hidden_size"]) == (24, 64)
    disc, info = ElectraForPreTraining.from_pretrained(str(exported), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    gen, info = ElectraForMaskedLM.from_pretrained(str(exported / "generator"), output_loading_info=True)
    assert not info["unexpected_keys"] and set(info["missing_keys"]) <= {"generator_lm_head.weight"}
    assert (gen.config.embedding_size, gen.config.hidden_size) == (24, 16)
    assert disc.electra.embeddings_project.weight.shape == (64, 24) and gen.electra.embeddings_project.weight.shape == (16, 24)
    ours = _ours(out)
    objective = ours.objectives["electra"]
    ids, mask, _ = _probe(config["vocab_size"], config["pad_token_id"])
    real = mask.bool()
    with torch.no_grad():
        reference = disc.eval()(input_ids=ids, attention_mask=mask).logits
        logits = objective.discriminator_predictions(ours.bert(ids, mask).last_hidden)
        torch.testing.assert_close(logits[real], reference[real], rtol=0, atol=1e-4)
        h = objective.generator(objective.embeddings_project(ours.bert.embeddings(ids)), mask)
        head = objective.generator_head
        gen_logits = F.linear(head.transform(h), ours.bert.embeddings.word_embeddings.weight, head.bias)
        torch.testing.assert_close(gen_logits[real], gen.eval()(input_ids=ids, attention_mask=mask).logits[real],
                                   rtol=0, atol=1e-4)
    assert reference[real].std() > 1e-3
    assert "| embedding size | 24 (projected to the hidden size) |" in (exported / "README.md").read_text()
