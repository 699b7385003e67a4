"""ELECTRA (`pipeline.objectives.electra`): its loss equals a loop written from the paper's equations (both
encoder families, and factorised embeddings), its discriminator loss equals `transformers.ElectraForPreTraining`'s on the same weights
and inputs, a sampled token equal to the original counts as original, the discriminator's loss never reaches
the generator, the generator's shape follows the paper's width rule, the one-pass sampling modes equal the
two-pass one, the sampling holds one vocabulary chunk at a time, and bad options are named."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.encoder import build_encoder_config
from pipeline.model.modernbert import MODERNBERT_SIZES, ModernBertConfig
from pipeline.objectives.base import StepProgress
from pipeline.objectives.replaced_tokens import generator_config
from pipeline.pretrain.pretrainer import PretrainModel
from pipeline.seeding import sampling_generator
from tests.objectives.conftest import SPECIAL, VOCAB, make_batch, tiny_model
from tests.objectives.test_fast_path import collated

SEED = 9


def _model(arch: str = "bert", options: dict | None = None, dropout: float = 0.0, **objectives) -> PretrainModel:
    opts = {"electra": options or {}}
    names = {"electra": 1.0, **objectives}
    if arch in ("bert", "factorised"):  # factorised: embeddings 24 wide under the hidden 64 (`model.embedding_size`)
        factorised = {"embedding_size": 24} if arch == "factorised" else {}
        return tiny_model(names, opts, dropout=dropout, attention_dropout=dropout, **factorised)
    torch.manual_seed(0)
    config = ModernBertConfig(**MODERNBERT_SIZES["tiny"], vocab_size=VOCAB, max_position=64, dropout=dropout,
                              attention_dropout=dropout)
    return PretrainModel(config, names, SPECIAL, objective_options=opts, seed=0, kernels="torch")


def _corrupted_ids(model: PretrainModel, batch: dict, **kwargs) -> tuple[torch.Tensor, dict]:
    """X^corrupt (the main model's only input in an ELECTRA step) and the step's metrics."""
    seen = []
    handle = model.bert.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    _, metrics = model(batch, sampling_seed=SEED, **kwargs)
    handle.remove()
    assert len(seen) == 1
    return seen[0], metrics


def _word_embeddings(model: PretrainModel) -> torch.Tensor:
    emb = model.bert.embeddings
    return (emb.tok_embeddings if hasattr(emb, "tok_embeddings") else emb.word_embeddings).weight


@pytest.mark.parametrize("arch", ["bert", "modernbert", "factorised"])
def test_loss_equals_a_loop_over_the_papers_equations(arch):
    """Clark et al. 2020, Sec. 2, position by position:
    L_MLM = mean_i -log p_G(x_i | x^masked), x̂_i = argmax_v (z_iv + G_iv) (a softmax sample, the
    micro-batch's Gumbel draws), L_Disc = mean over non-pad t of -y_t log D_t - (1 - y_t) log(1 - D_t),
    y_t = 1[x̂_t != x_t], L = L_MLM + 50 L_Disc."""
    model = _model(arch)
    obj = model.objectives["electra"]
    batch = make_batch(seed=4)
    loss, metrics = model(batch, sampling_seed=SEED)
    masked, labels, mask, original = batch["masked_ids"], batch["mlm_labels"], batch["attention_mask"], batch["input_ids"]
    with torch.no_grad():
        generator_states = obj.generator(obj.embeddings_project(model.bert.embeddings(masked)), mask)
        head, weight = obj.generator_head, _word_embeddings(model)
        selected = [(b, i) for b in range(masked.shape[0]) for i in range(masked.shape[1]) if labels[b, i] != -100]
        uniform = torch.rand((len(selected), VOCAB), generator=sampling_generator(SEED, "cpu"))
        corrupted = masked.clone()
        gen_terms = []
        for n, (b, i) in enumerate(selected):
            z = weight @ head.transform(generator_states[b, i]) + head.bias
            gen_terms.append(-(z[labels[b, i]] - torch.logsumexp(z, 0)))
            gumbel = -torch.log(-torch.log(uniform[n].clamp(min=torch.finfo(torch.float32).tiny)))
            corrupted[b, i] = int(torch.argmax(z + gumbel))
        hidden = model.bert(corrupted, mask).last_hidden
        disc_terms = []
        for b in range(masked.shape[0]):
            for t in range(masked.shape[1]):
                if mask[b, t]:
                    p = torch.sigmoid(obj.discriminator_predictions(hidden[b, t]))
                    y = float(corrupted[b, t] != original[b, t])
                    disc_terms.append(-(y * torch.log(p) + (1 - y) * torch.log(1 - p)))
    gen_loss, disc_loss = torch.stack(gen_terms).mean(), torch.stack(disc_terms).mean()
    assert metrics["electra/gen_loss"].item() == pytest.approx(gen_loss.item(), rel=1e-5)
    assert metrics["electra/disc_loss"].item() == pytest.approx(disc_loss.item(), rel=1e-5)
    assert loss.item() == pytest.approx(gen_loss.item() + 50.0 * disc_loss.item(), rel=1e-5)
    replaced = sum(int(corrupted[b, i] != original[b, i]) for b, i in selected)
    assert metrics["electra/replaced_fraction"].item() == pytest.approx(replaced / len(selected))
    assert 0 < replaced  # the draws replaced something, so both classes are in the loss


def test_discriminator_loss_equals_transformers_electra_for_pretraining():
    from transformers import ElectraForPreTraining

    from pipeline.export.electra_adapter import electra_hf_config, to_electra_hf

    model = _model()
    batch = make_batch(seed=5)
    corrupted, metrics = _corrupted_ids(model, batch)
    hf = ElectraForPreTraining(electra_hf_config(model.config, SPECIAL)).eval()
    missing, unexpected = hf.load_state_dict(to_electra_hf(model.state_dict()), strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    labels = (corrupted != batch["input_ids"]).long()
    with torch.no_grad():
        out = hf(input_ids=corrupted, attention_mask=batch["attention_mask"], labels=labels)
    assert metrics["electra/disc_loss"].item() == pytest.approx(out.loss.item(), rel=1e-5)
    assert labels[batch["attention_mask"].bool()].float().mean() > 0.05  # replaced tokens are in the loss


def test_a_sampled_token_equal_to_the_original_counts_as_original():
    """Every selected position holds token 10 and the generator's bias makes 10 certain: every sample equals
    the original, so nothing is "replaced" and the discriminator's target is 0 everywhere."""
    model = _model()
    batch = make_batch(seed=6)
    selected = batch["mlm_labels"] != -100
    kept = selected & (batch["masked_ids"] == batch["input_ids"])
    for key in ("input_ids", "mlm_labels"):
        batch[key] = batch[key].masked_fill(selected, 10)
    batch["masked_ids"] = batch["masked_ids"].masked_fill(kept, 10)
    with torch.no_grad():
        model.objectives["electra"].generator_head.bias[10] = 1e4
    corrupted, metrics = _corrupted_ids(model, batch)
    assert torch.equal(corrupted[selected], batch["input_ids"][selected])
    assert metrics["electra/replaced_fraction"].item() == 0.0
    logits = model.objectives["electra"].discriminator_predictions(model.bert(corrupted, batch["attention_mask"]).last_hidden)
    real = batch["attention_mask"].bool()
    assert metrics["electra/disc_loss"].item() == pytest.approx(F.softplus(logits[real]).mean().item(), rel=1e-5)
    assert math.isnan(metrics["electra/rtd_auc"].item())  # no replaced token: AUC undefined, not a number


def test_the_discriminator_loss_never_reaches_the_generator():
    model = _model(options={"lambda_gen": 0.0})
    loss, _ = model(make_batch(seed=2), sampling_seed=SEED)
    loss.backward()
    generator = [n for n, p in model.named_parameters() if n.startswith(("objectives.electra.generator",
                                                                          "objectives.electra.embeddings_project"))]
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert generator and all(grads[n] is None or not grads[n].any() for n in generator)  # weight 0: zeros at most
    assert grads["bert.encoder.layer.0.attention.self.qkv.weight"].abs().sum() > 0  # the discriminator did learn
    disc_only = _model(options={"lambda_disc": 0.0})
    loss, _ = disc_only(make_batch(seed=2), sampling_seed=SEED)
    loss.backward()
    grads = {n: p.grad for n, p in disc_only.named_parameters()}
    assert all(g is None or not g.any() for n, g in grads.items() if n.startswith(("bert.encoder.", "objectives.electra.disc")))
    assert grads["objectives.electra.generator_head.bias"].abs().sum() > 0


def test_generator_shape_follows_the_papers_width_rule():
    small = build_encoder_config("electra-small", vocab_size=VOCAB)
    assert (lambda g: (g.hidden_size, g.num_heads, g.ffn_size))(generator_config(small, 0.25)) == (64, 1, 256)
    base = build_encoder_config("base", vocab_size=VOCAB)
    assert (lambda g: (g.hidden_size, g.num_heads, g.ffn_size))(generator_config(base, 0.33333)) == (256, 4, 1024)
    assert generator_config(base, 1.0) is base
    model = _model()
    obj = model.objectives["electra"]
    assert len(obj.generator.layer) == model.config.num_layers  # ELECTRA: the generator at full depth
    assert obj.embeddings_project.weight.shape == (16, 64) and obj.generator_head.transform.dense.weight.shape == (64, 16)
    assert not any("embeddings." in n for n, _ in obj.named_parameters())  # the embeddings are the main model's
    full = _model(options={"generator_width": 1.0}).objectives["electra"]
    assert full.embeddings_project is None and full.generator.layer[0].intermediate.dense.out_features == 128


def test_factorised_embeddings_feed_the_generator_at_their_width():
    """E = 24 under H = 64: the discriminator projects E -> H, the generator E -> H_G = 16 (ELECTRA's generator
    `embeddings_project` with `embedding_size`), its head maps H_G -> E before the tied E-wide embeddings; a
    generator as wide as E has no projection (as `transformers.ElectraModel`); COCO-LM refuses E != H by name."""
    model = _model("factorised")
    obj = model.objectives["electra"]
    assert model.bert.embeddings_project.weight.shape == (64, 24)
    assert obj.embeddings_project.weight.shape == (16, 24) and obj.generator_head.transform.dense.weight.shape == (24, 16)
    assert tiny_model({"electra": 1.0}, {"electra": {"generator_width": 0.375}}, embedding_size=24
                      ).objectives["electra"].embeddings_project is None  # H_G = 24 = E
    loss, _ = model(make_batch(seed=2), sampling_seed=SEED)
    loss.backward()
    for name in ("bert.embeddings.word_embeddings.weight", "bert.embeddings_project.weight",
                 "objectives.electra.embeddings_project.weight"):
        assert dict(model.named_parameters())[name].grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match=r"model\.embedding_size=24 .factorised embeddings. is not implemented for cocolm"):
        tiny_model({"cocolm": 1.0}, embedding_size=24)


@pytest.mark.parametrize("options, match", [
    ({"generator_width": 0.0}, "generator_width"),
    ({"generator_width": 1.5}, "generator_width"),
    ({"generator_layers": 0}, "generator_layers"),
    ({"sample_mode": "greedy"}, "sample_mode"),
    ({"sample_temperature": 0.0}, "sample_temperature"),
    ({"lambda_disc": -1.0}, "lambda_disc"),
    ({"view": "span_masked"}, "view"),
    # a wrong type from YAML (`1/4` is a string) or null: one line naming the option, not a TypeError
    ({"generator_width": "1/4"}, "generator_width must be a finite number > 0 and <= 1 .a fraction of the hidden "
                                 "size., got '1/4'"),
    ({"generator_width": None}, "generator_width must be a finite number"),
    ({"generator_width": True}, "generator_width must be a finite number"),  # YAML's true is not 1
    ({"generator_layers": 1.5}, "generator_layers must be an integer >= 1, got 1.5"),
    ({"generator_layers": "2"}, "generator_layers must be an integer"),
    ({"sample_temperature": "1"}, "sample_temperature must be a finite number > 0"),
    ({"sample_temperature": math.inf}, "sample_temperature must be a finite number > 0, got inf"),  # uniform draws
    ({"sample_temperature": math.nan}, "sample_temperature must be a finite number > 0, got nan"),
    ({"lambda_disc": math.nan}, "lambda_disc must be a finite number >= 0, got nan"),  # every loss nan
    ({"lambda_gen": math.inf}, "lambda_gen must be a finite number >= 0, got inf"),
    ({"lambda_disc": 0, "lambda_gen": 0}, "lambda_disc and lambda_gen are both 0: electra would train nothing"),
])
def test_bad_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=r"objective_options\.electra\." + match.split(" ")[0].replace(".", r"\.")):
        _model(options=options)
    if " " in match:
        with pytest.raises(ValueError, match=match):
            _model(options=options)


@pytest.mark.parametrize("options, match", [
    ({"generator_layers": 1.5}, "generator_layers must be an integer >= 1, got 1.5"),
    ({"sample_temperature": "1"}, "sample_temperature must be a finite number > 0, got '1'"),
    ({"sample_mode": "train"}, "sample_mode must be one of .'eval', 'zero_dropout'., got 'train'"),
    ({"lambda_copy": math.nan}, "lambda_copy must be a finite number >= 0, got nan"),
    ({"lambda_scl": -1.0}, "lambda_scl must be a finite number >= 0, got -1.0"),
    ({"tau": "0.1"}, "tau must be a finite number > 0, got '0.1'"),
])
def test_cocolm_refuses_the_shared_generator_options_alike(options, match):
    """COCO-LM shares the generator options' checks (`replaced_tokens.check_generator_options`) and its weights
    are checked like ELECTRA's: the same one-line refusals under objective_options.cocolm."""
    with pytest.raises(ValueError, match=r"^objective_options\.cocolm\." + match):
        tiny_model({"cocolm": 1.0}, {"cocolm": options})


def test_a_width_the_head_size_does_not_divide_is_refused_with_its_numbers():
    with pytest.raises(ValueError, match="generator_width=0.45 gives a generator hidden size of 346 .of 768., which 5 "
                                         "heads of the main model's head size 64 do not divide"):
        generator_config(build_encoder_config("base", vocab_size=VOCAB), 0.45)
    with pytest.raises(ValueError, match=r"objective_options\.electra\.generator_width.*odd"):
        _model("modernbert", options={"generator_width": 0.3})  # 19 wide: rotary needs an even head size


def test_one_pass_sampling_modes_equal_the_two_pass_one_without_dropout():
    """`train` (the public code: the training pass, detached) and `zero_dropout` run the generator once;
    `eval` runs an extra no-grad pass. With dropout off the three passes are the same function: the same
    draws, loss and gradients."""
    results = []
    for mode in ("eval", "zero_dropout", "train"):
        model = _model(options={"sample_mode": mode})
        loss, metrics = model(make_batch(seed=3), sampling_seed=SEED)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    for loss, grads in results[1:]:
        assert loss == results[0][0]
        assert grads.keys() == results[0][1].keys()
        assert all(torch.equal(grads[n], results[0][1][n]) for n in grads)


def test_train_mode_samples_through_dropout_and_eval_mode_does_not():
    """With dropout on, `eval` and `zero_dropout` sample from the dropout-free generator (equal draws);
    `train` samples from the training pass, whose dropout changes the draws."""
    batch = make_batch(seed=3)
    draws = {}
    for mode in ("eval", "zero_dropout", "train"):
        model = _model(options={"sample_mode": mode}, dropout=0.3)
        with torch.no_grad():  # logits far from uniform, so that what dropout changes changes the draws
            model.objectives["electra"].generator_head.transform.LayerNorm.weight.fill_(50.0)
        draws[mode] = _corrupted_ids(model, batch)[0]
    assert torch.equal(draws["eval"], draws["zero_dropout"])
    assert not torch.equal(draws["train"], draws["eval"])


def test_sampling_holds_one_vocabulary_chunk_at_a_time(monkeypatch):
    import pipeline.objectives.electra as electra

    monkeypatch.setattr(electra, "SAMPLE_CHUNK", 40)  # the 97-word vocabulary in chunks of 40, 40, 17
    widths = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: widths.append(w.shape[0]) or real_linear(x, w, b))
    model = _model()
    model(collated(model, seed=3), StepProgress(record_metrics=False), sampling_seed=4)
    assert [w for w in widths if w in (40, 17)] == [40, 40, 17]
    assert widths.count(VOCAB) == 1  # the generator's MLM loss; the discriminator never projects to the vocabulary


def test_detection_metrics_only_on_logged_steps_and_health_reads_the_discriminator():
    from pipeline.monitor.health import token_cosine_tensor

    model = _model()
    batch = make_batch(seed=7)
    corrupted, logged = _corrupted_ids(model, batch, progress=StepProgress(record_metrics=True))
    _, quiet = _corrupted_ids(model, batch, progress=StepProgress(record_metrics=False))
    detection = {"electra/rtd_auc", "electra/rtd_auc_chance", "electra/rtd_accuracy", "electra/rtd_accuracy_chance"}
    assert detection <= logged.keys() and not detection & quiet.keys()
    assert logged["electra/loss"] == quiet["electra/loss"]
    with torch.no_grad():
        hidden = model.bert(corrupted, batch["attention_mask"]).last_hidden
    content = batch["attention_mask"].bool() & ~torch.isin(corrupted, torch.tensor([SPECIAL["cls"], SPECIAL["sep"]]))
    assert logged["health/token_cosine"].item() == pytest.approx(token_cosine_tensor(hidden, content).item(), rel=1e-5)


def test_unigram_bias_init_reaches_the_generator_head():
    import numpy as np

    from pipeline.pretrain.build import fill_unigram_tensors, unigram_bias

    model = _model()
    counts = np.arange(VOCAB, dtype=np.int64) + 1
    names = fill_unigram_tensors(model, counts, output_biases=True)
    assert "objectives.electra.generator_head.bias" in names
    assert torch.equal(model.objectives["electra"].generator_head.bias.detach(), unigram_bias(counts))


def test_flops_count_the_narrow_generator_head_at_its_shape():
    """The generator head's transform maps H_G = 16 to H = 64: its FLOPs are 2 N H_G H, not 2 N H_G^2
    (`pipeline.train.metrics.FlopCounter` reads both widths from the call)."""
    from pipeline.train.metrics import FlopCounter

    transform = _model().objectives["electra"].generator_head.transform
    counter = FlopCounter(transform)
    with torch.no_grad():
        transform(torch.randn(5, 16))
    assert counter.pop() == 2.0 * 5 * 16 * 64
