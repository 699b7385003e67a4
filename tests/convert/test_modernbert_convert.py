"""`model.arch=modernbert` both ways with Hugging Face: `cpt-convert` writes a plain `ModernBertForMaskedLM`
directory (no remote code) whose logits equal the training model's, the card names the family and the
objectives, and `cpt-finetune` fine-tunes the export."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.export.convert import convert
from pipeline.pretrain.build import model_from_meta
from pipeline.train.run_meta import RunMeta
from tests.train.runs import module_state, run_inprocess, tag_dir

ARCH = "model.arch=modernbert"


@pytest.fixture(scope="module")
def modernbert_run(tmp_path_factory, tiny_shards_dir) -> Path:
    """MLM + TACO + CAPT + BERT-NCE on a tiny ModernBERT, 3 steps (dropout on, so the weights really move)."""
    out = tmp_path_factory.mktemp("mb_run") / "run"
    previous = torch.get_num_threads()
    assert run_inprocess("tiny-taco", tiny_shards_dir, out, ARCH, "train.total_steps=3", "train.checkpoint_every=3",
                         "objectives={mlm: 1.0, taco: 1.0, capt: 0.5, mlm-nce: 0.5}") == 0
    torch.set_num_threads(previous)
    return out


@pytest.fixture(scope="module")
def modernbert_export(modernbert_run, tmp_path_factory) -> Path:
    return convert(modernbert_run, tmp_path_factory.mktemp("mb_hf") / "hf")


def _ours(run: Path):
    tag = tag_dir(run, 3)
    model = model_from_meta(RunMeta.read(tag))
    model.load_state_dict(module_state(tag), strict=False)  # buffers (log q) included
    return model.eval()


def _probe(vocab: int, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows of 64 tokens (longer than the tiny preset's 16-token window), two right-padded."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 64), generator=gen)
    lengths = torch.tensor([64, 41, 9])
    mask = (torch.arange(64)[None] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad), mask, lengths


def test_export_is_a_plain_modernbert_with_equal_logits(modernbert_run, modernbert_export):
    from transformers import AutoModelForMaskedLM, ModernBertForMaskedLM

    config = json.loads((modernbert_export / "config.json").read_text())
    assert config["model_type"] == "modernbert" and config["architectures"] == ["ModernBertForMaskedLM"]
    assert "auto_map" not in config  # nothing remote: the class ships with transformers
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    hf = AutoModelForMaskedLM.from_pretrained(str(modernbert_export), attn_implementation="sdpa").eval()
    assert type(hf) is ModernBertForMaskedLM
    assert hf.decoder.weight.data_ptr() == hf.model.embeddings.tok_embeddings.weight.data_ptr()  # tied

    ours = _ours(modernbert_run)
    ids, mask, lengths = _probe(config["vocab_size"], config["pad_token_id"])
    with torch.no_grad():
        reference = hf(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        # NCE trained the head too (with MLM): the bias is exported as trained, so the logits are ours
        for mode, seqlens in (("masked", None), ("varlen", lengths)):
            ours.bert.encoder.attention = mode
            logits = ours.cls(ours.bert(ids, mask, seqlens=seqlens).last_hidden)
            torch.testing.assert_close(logits[real], reference[real], rtol=0, atol=1e-4, msg=mode)
        full = ids[:1]  # an unpadded batch: no mask at all (the dense path)
        torch.testing.assert_close(ours.cls(ours.bert(full).last_hidden), hf(input_ids=full).logits, rtol=0, atol=1e-4)
    assert reference.abs().max() > 0.1  # the comparison is not between two near-zero tensors


def test_export_tensors_and_card(modernbert_run, modernbert_export):
    exported = load_file(modernbert_export / "model.safetensors")
    trained = module_state(tag_dir(modernbert_run, 3))
    assert torch.equal(exported["model.layers.1.attn.Wqkv.weight"], trained["bert.encoder.layers.1.attn.Wqkv.weight"])
    assert torch.equal(exported["head.norm.weight"], trained["cls.predictions.transform.norm.weight"])
    assert "decoder.weight" not in exported and not any(k.startswith(("bert.", "cls.")) for k in exported)
    heads = load_file(modernbert_export / "objective_heads.safetensors")
    assert any(k.startswith("objectives.capt.aggregation.") for k in heads)

    card = (modernbert_export / "README.md").read_text()
    front = card.split("---")[1]
    assert "- modernbert" in front and "- taco" in front and "- capt" in front and "- mlm-nce" in front
    assert "# ModernBERT-style encoder pretrained with capt + mlm + mlm-nce + taco" in card
    assert "ModernBertForMaskedLM" in card and "sliding window of 16 tokens" in card
    assert "token_type_embeddings" not in card  # BERT's segment-B advice does not apply


@pytest.mark.slow  # zero_to_fp32.py runs in its own process, as a user runs it
def test_zero_to_fp32_output_converts_to_the_same_modernbert(modernbert_run, modernbert_export, tmp_path):
    """DeepSpeed's own `zero_to_fp32.py`, run as a user would on a ModernBERT checkpoint, writes the training
    names (`bert.*`, which `ModernBertForMaskedLM` does not load); `cpt-convert TAG OUT --weights ITS_OUTPUT`
    (its `.bin`, or safetensors with one name per tied storage) gives the very tensors of the direct export,
    and the converted model computes the training model's logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForMaskedLM, ModernBertForMaskedLM

    from pipeline.export.convert import main as convert_main
    from tests.convert.test_zero_to_fp32 import zero_to_fp32

    tag = tag_dir(modernbert_run, 3)
    weights = {"bin": tmp_path / "z_bin", "safetensors": tmp_path / "z_safetensors"}
    proc = zero_to_fp32(modernbert_run / "checkpoints", tag.name, weights["bin"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(weights["bin"] / "pytorch_model.bin", weights_only=True)
    assert "bert.encoder.layers.0.attn.Wqkv.weight" in state and not any(k.startswith("model.") for k in state)
    weights["safetensors"].mkdir()
    save_file({k: v.contiguous() for k, v in state.items() if k != "cls.predictions.decoder.weight"},
              str(weights["safetensors"] / "model.safetensors"))

    direct = load_file(modernbert_export / "model.safetensors")
    ours = _ours(modernbert_run)
    for form, source in weights.items():
        out = tmp_path / f"hf_{form}"
        assert convert_main([str(tag), str(out), "--weights", str(source)]) == 0, form
        got = load_file(out / "model.safetensors")
        assert got.keys() == direct.keys(), form
        for key in direct:
            assert torch.equal(got[key], direct[key]), (form, key)
        assert "zero_to_fp32.py" in (out / "README.md").read_text()  # the card names where the weights came from
        hf = AutoModelForMaskedLM.from_pretrained(str(out), attn_implementation="sdpa").eval()
        assert type(hf) is ModernBertForMaskedLM
        ids, mask, lengths = _probe(hf.config.vocab_size, hf.config.pad_token_id)
        real = mask.bool()
        with torch.no_grad():
            ours.bert.encoder.attention = "varlen"
            logits = ours.cls(ours.bert(ids, mask, seqlens=lengths).last_hidden)
            reference = hf(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits[real], reference[real], rtol=0, atol=1e-4, msg=form)
        assert reference.abs().max() > 0.1


def test_cocolm_generator_exports_as_a_second_modernbert(tiny_shards_dir, tmp_path):
    """COCO-LM on ModernBERT: `--with-generator` writes `generator/`, a plain `ModernBertForMaskedLM` that
    computes the training generator's logits (shared embeddings -> generator layers + final norm -> its own
    head, tied projection, its own bias); the main export still equals the main model."""
    from transformers import AutoModelForMaskedLM

    out = tmp_path / "run"
    assert run_inprocess("tiny-cocolm", tiny_shards_dir, out, ARCH, "train.total_steps=3",
                         "train.checkpoint_every=3") == 0
    exported = convert(out, tmp_path / "hf", with_generator=True)
    ours = _ours(out)
    objective = ours.objectives["cocolm"]
    generator = AutoModelForMaskedLM.from_pretrained(str(exported / "generator"), attn_implementation="sdpa").eval()
    main = AutoModelForMaskedLM.from_pretrained(str(exported), attn_implementation="sdpa").eval()
    assert generator.config.num_hidden_layers == 1 and main.config.num_hidden_layers == 3
    heads = load_file(exported / "objective_heads.safetensors")
    assert not any(".generator." in k or ".generator_head." in k for k in heads)  # exported as a model instead
    assert any(k.startswith("objectives.cocolm.copy_head.") for k in heads)
    ids, mask, lengths = _probe(generator.config.vocab_size, generator.config.pad_token_id)
    real = mask.bool()
    with torch.no_grad():
        for mode, seqlens in (("masked", None), ("varlen", lengths)):
            objective.generator.attention = mode
            h = objective.generator(ours.bert.embeddings(ids), mask, seqlens)
            head = objective.generator_head
            logits = torch.nn.functional.linear(head.transform(h), ours.bert.embeddings.tok_embeddings.weight, head.bias)
            reference = generator(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(logits[real], reference[real], rtol=0, atol=1e-4, msg=mode)
        main_logits = ours.cls(ours.bert(ids, mask).last_hidden)
        torch.testing.assert_close(main_logits[real], main(input_ids=ids, attention_mask=mask).logits[real],
                                   rtol=0, atol=1e-4)
    assert "COCO-LM auxiliary generator" in (exported / "generator" / "README.md").read_text()


@pytest.mark.slow
def test_finetune_on_the_export(modernbert_export, tmp_path, capsys):
    """`cpt-finetune` on the converted directory: `ModernBertForSequenceClassification`, loss goes down."""
    from pipeline.eval.finetune import main
    from tests.convert.test_finetune import write_keyword_task

    task = write_keyword_task(tmp_path / "keyword", n_train=160, n_dev=80)
    output = tmp_path / "keyword.json"
    argv = ["--model", str(modernbert_export), "--task-dir", str(task), "--seeds", "1", "--lr", "1e-3",
            "--epochs", "3", "--batch-size", "16", "--max-length", "32", "--threads", "1", "--output", str(output)]
    assert main(argv) == 0
    result = json.loads(output.read_text())
    assert result["problem"] == "classification" and result["n_train"] == 160
    assert result["runs"][0]["metrics"]["accuracy"] >= 0.75, result["runs"]  # chance: 0.5


@pytest.mark.slow
def test_zero3_two_ranks_train_and_convert(tiny_shards_dir, tmp_path):
    """ZeRO-3 on 2 ranks (parameters partitioned: the tied projection and COCO-LM's shared embeddings are
    gathered inside their modules' forwards): COCO-LM + MLM trains with finite losses, the partitioned
    checkpoint consolidates and converts (main model and generator), and both load as plain ModernBERTs."""
    from transformers import AutoModelForMaskedLM

    from pipeline.train.metrics import read_jsonl
    from tests.train.runs import run_torchrun

    out = tmp_path / "run"
    run_torchrun("tiny-cocolm", tiny_shards_dir, out, ARCH, "deepspeed.config=zero3", "train.total_steps=3",
                 "train.checkpoint_every=3", "objectives={mlm: 1.0, cocolm: 1.0}")
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    exported = convert(out, tmp_path / "hf", with_generator=True)
    for directory in (exported, exported / "generator"):
        model = AutoModelForMaskedLM.from_pretrained(str(directory)).eval()
        ids, mask, _ = _probe(model.config.vocab_size, model.config.pad_token_id)
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits).all()
