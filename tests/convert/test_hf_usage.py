"""A converted directory works offline with the standard Hugging Face entry points."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.slow
RUN = "zero0-1rank-mlm"
TEXTS = ["Return a new list containing all items from the iterable.", "The file is closed when the block ends."]


def test_auto_model_gives_the_training_encoder_states(trained_runs, converted):
    from transformers import AutoModel

    run, out = trained_runs(RUN), converted(RUN)
    model = AutoModel.from_pretrained(out).eval()
    assert type(model).__name__ == "BertModel"
    with torch.no_grad():
        ids, mask = run.reference["input_ids"], run.reference["attention_mask"]
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(hidden, run.reference["hidden"], rtol=1e-5, atol=1e-5)


def test_sequence_classification_loads_the_encoder_and_trains(trained_runs, converted):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    out = converted(RUN)
    model = AutoModelForSequenceClassification.from_pretrained(out, num_labels=3)
    weights = load_file(out / "model.safetensors")
    for key in ("bert.embeddings.word_embeddings.weight", "bert.encoder.layer.1.output.dense.weight"):
        torch.testing.assert_close(model.state_dict()[key], weights[key], rtol=0, atol=0)
    ids = trained_runs(RUN).reference["input_ids"]
    loss = model(input_ids=ids, labels=torch.tensor([0, 2])).loss
    loss.backward()
    assert torch.isfinite(loss) and model.classifier.weight.grad.abs().sum() > 0


def test_tokenizer_round_trips(trained_runs, converted, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    out = converted(RUN)
    original = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    exported = AutoTokenizer.from_pretrained(out)
    meta = json.loads((trained_runs(RUN).tag_dir / "pipeline_meta.json").read_text())
    for name, token_id in meta["special_tokens"].items():
        assert getattr(exported, f"{name}_token_id") == token_id, name
    for text in TEXTS:
        assert exported(text).input_ids == original(text).input_ids
        assert exported.decode(exported(text).input_ids, skip_special_tokens=True) == original.decode(
            original(text).input_ids, skip_special_tokens=True)
    pair = exported(*TEXTS)
    assert pair.input_ids == original(*TEXTS).input_ids and 1 in pair.token_type_ids
    assert exported.model_max_length == meta["encoder_config"]["max_position"]


def test_fill_mask_pipeline_scores_are_the_model_probabilities(converted):
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    out = converted(RUN)
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = f"Return a new {tokenizer.mask_token} containing all items."
    predictions = pipeline("fill-mask", model=str(out), top_k=5)(text)
    assert len(predictions) == 5 and all(tokenizer.mask_token not in p["sequence"] for p in predictions)

    model = AutoModelForMaskedLM.from_pretrained(out).eval()
    enc = tokenizer(text, return_tensors="pt")
    position = (enc.input_ids[0] == tokenizer.mask_token_id).nonzero().item()
    with torch.no_grad():
        probs = model(**enc).logits[0, position].softmax(-1)
    top = probs.topk(5)
    assert [p["token"] for p in predictions] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([p["score"] for p in predictions]), top.values, rtol=1e-4, atol=1e-6)
