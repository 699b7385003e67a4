"""`cpt-sts`: zero-shot STS of a converted model. Its Spearman equals an independent computation (scipy)
on the same embeddings, and those are `SentenceTransformer(dir).encode`'s; the references and the
paired bootstrap are recomputed independently; bad input is one line before any compute."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.eval import sts
from pipeline.eval.embed import open_encoder
from pipeline.tokenizer_checks import TOKENIZER_FILES
from tests.eval.conftest import write_sts

REPO = Path(__file__).resolve().parents[2]
#: The real STS-B (SentEval copy) beside the project, when it is there (../shared/data/README.md).
REAL_STSB = Path(os.environ.get("CPT_STSB_DIR", REPO.parent / "shared" / "data" / "sts-b"))


def scipy_spearman(predicted, gold) -> float:
    from scipy.stats import spearmanr

    return 100 * float(spearmanr(predicted, gold).statistic)


def scipy_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.spatial.distance import cosine

    return np.array([1 - cosine(x, y) for x, y in zip(a.astype(np.float64), b.astype(np.float64))])


@contextlib.contextmanager
def recorded_embeddings():
    """{(weights, sentences): array} of every `Encoder.embed` call inside the block; weights "converted" or
    "random_init <seed>"."""
    from pipeline.eval.embed import Encoder

    seen: dict[tuple[str, tuple[str, ...]], np.ndarray] = {}
    original = Encoder.embed

    def spy(self, sentences, *args, **kwargs):
        vectors = original(self, sentences, *args, **kwargs)
        seen[self.weights, tuple(sentences)] = vectors
        return vectors

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Encoder, "embed", spy)
        yield seen


@pytest.fixture(scope="module")
def result(sts_model, tmp_path_factory):
    """One cpt-sts run on the test's own STS files (200 bootstrap draws): the data, the JSON it wrote, and
    the embeddings it computed ({(trained?, sentences): array}, recorded by a spy on `Encoder.embed`).
    The independent computations use these: at 3 training steps every sentence's vector is nearly the
    same one (cosines ~0.99), and recomputing them with another thread count moves ranks."""
    data = write_sts(tmp_path_factory.mktemp("sts") / "sts-b")
    out = data.parent / "results" / "sts.json"
    argv = [str(sts_model), "--data", str(data), "--bootstrap", "200", "--seed", "3", "--out", str(out), "--json"]
    with recorded_embeddings() as seen:
        assert sts.main(argv) == 0
    return data, json.loads(out.read_text()), seen


def model_cosines(seen, pairs, weights: str = "converted") -> np.ndarray:
    """scipy's cosines of the embeddings the command computed for `pairs` (`weights`: "converted", or
    "random_init <seed>")."""
    return scipy_cosines(seen[weights, tuple(pairs.first)], seen[weights, tuple(pairs.second)])


def test_spearman_equals_scipy_on_the_same_embeddings(sts_model, result, monkeypatch):
    data, record, seen = result
    for split in ("dev", "test"):
        pairs = sts.read_sts(data / f"{split}.tsv")
        expected = scipy_spearman(model_cosines(seen, pairs), pairs.scores)
        assert record["splits"][split]["model"]["spearman"] == pytest.approx(expected, abs=1e-4)
        # the random-init floor: the mean over init seeds 3, 4, 5 of each one's Spearman, and their spread
        per_seed = [scipy_spearman(model_cosines(seen, pairs, f"random_init {s}"), pairs.scores) for s in (3, 4, 5)]
        floor = record["splits"][split]["random_init"]
        assert floor["spearman"] == pytest.approx(np.mean(per_seed), abs=1e-4)
        np.testing.assert_allclose(floor["per_seed"], per_seed, atol=1e-4)
        assert floor["seed_sd"] == pytest.approx(np.std(per_seed, ddof=1), abs=1e-3) and floor["seed_sd"] > 0
        assert record["splits"][split]["n_pairs"] == len(pairs) == 60
    assert record["random_init_seeds"] == [3, 4, 5]
    st = pytest.importorskip("sentence_transformers")  # the embeddings are sentence-transformers' own
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    encoded = st.SentenceTransformer(str(sts_model), device="cpu", local_files_only=True).encode(pairs.first)
    np.testing.assert_allclose(encoded, seen["converted", tuple(pairs.first)], rtol=0, atol=2e-5)


def test_references_recomputed_independently(sts_model, result):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    data, record, _ = result
    pairs = sts.read_sts(data / "test.tsv")
    tokenizer = AutoTokenizer.from_pretrained(str(sts_model))
    overlap = [len(set(tokenizer.tokenize(a)) & set(tokenizer.tokenize(b))) / len(set(tokenizer.tokenize(a))
                                                                               | set(tokenizer.tokenize(b)))
               for a, b in zip(pairs.first, pairs.second)]
    test = record["splits"]["test"]
    assert test["token_overlap"]["spearman"] == pytest.approx(scipy_spearman(overlap, pairs.scores), abs=1e-4)
    table = load_file(sts_model / "model.safetensors")["bert.embeddings.word_embeddings.weight"].numpy()

    def bag(sentence: str) -> np.ndarray:
        return table[tokenizer(sentence, add_special_tokens=False)["input_ids"]].mean(0)

    cos = scipy_cosines(np.stack([bag(s) for s in pairs.first]), np.stack([bag(s) for s in pairs.second]))
    assert test["input_embeddings"]["spearman"] == pytest.approx(scipy_spearman(cos, pairs.scores), abs=1e-4)
    # random init: another model than the trained one, the same one for the same seed
    assert test["random_init"]["spearman"] != test["model"]["spearman"]
    encoder = open_encoder(sts_model)
    first, again, other = (encoder.random_init(seed).model.state_dict() for seed in (3, 3, 4))
    assert all(torch.equal(first[k], again[k]) for k in first) and not all(torch.equal(first[k], other[k])
                                                                           for k in first)
    assert not torch.equal(first["embeddings.word_embeddings.weight"],
                           encoder.model.state_dict()["embeddings.word_embeddings.weight"])
    assert test["token_overlap"]["spearman"] > 50  # the fixture's scores follow the words kept


def test_bootstrap_intervals_are_paired_percentiles(sts_model, result):
    data, record, seen = result
    pairs = sts.read_sts(data / "dev.tsv")
    model = model_cosines(seen, pairs)
    overlap = sts.token_overlap(open_encoder(sts_model), pairs)
    draws = np.random.default_rng(3).integers(0, len(pairs), size=(200, len(pairs)))
    boot_model = np.array([scipy_spearman(model[d], pairs.scores[d]) for d in draws])
    boot_overlap = np.array([scipy_spearman(overlap[d], pairs.scores[d]) for d in draws])
    dev = record["splits"]["dev"]
    np.testing.assert_allclose(dev["model"]["interval"], np.quantile(boot_model, [0.025, 0.975]), atol=1e-3)
    np.testing.assert_allclose(dev["model"]["minus_token_overlap"]["interval"],
                               np.quantile(boot_model - boot_overlap, [0.025, 0.975]), atol=1e-3)
    low, high = dev["model"]["interval"]
    assert low < dev["model"]["spearman"] < high and high - low > 1  # 60 pairs: a wide interval
    assert record["bootstrap"] == {"samples": 200, "seed": 3, "level": 0.95, "over": "pairs",
                                   "paired": "the same draws for every method"}


def test_json_on_request_is_the_file_out_writes(sts_model, tmp_path, capsys):
    data = write_sts(tmp_path / "sts", n_pairs=20)
    out = tmp_path / "r" / "sts.json"
    assert sts.main([str(sts_model), "--data", str(data), "--splits", "test", "--references", "--bootstrap", "0",
                     "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and list(printed["splits"]) == ["test"]
    assert set(printed["splits"]["test"]) == {"n_pairs", "model"} and sorted(os.listdir(out.parent)) == ["sts.json"]
    assert printed["command"].startswith("cpt-sts ") and printed["pooling"]["mode"] == "mean"


BAD_LINES = {
    "missing column": ("main\tMSRvid\t2012test\t0001\t3.000\ta man is running .",
                       "6 tab-separated columns, expected 7"),
    "score above 5": ("main\tMSRvid\t2012test\t0001\t5.200\ta man .\ta woman .", "score 5.200 outside 0-5"),
    "negative score": ("main\tMSRvid\t2012test\t0001\t-0.5\ta man .\ta woman .", "score -0.5 outside 0-5"),
    "score not a number": ("main\tMSRvid\t2012test\t0001\tfive\ta man .\ta woman .", "score 'five' is not a number"),
    "empty sentence": ("main\tMSRvid\t2012test\t0001\t3.000\ta man .\t  ", "sentence2 is empty"),
}


def _refuses(argv, capsys, monkeypatch) -> str:
    """`cpt-sts argv` exits 2 with one line on stderr, before the model is even opened."""
    def no_compute(*_args, **_kwargs):
        raise AssertionError("the model was opened before the input was checked")

    monkeypatch.setattr(sts, "open_encoder", no_compute)
    assert sts.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_sts_line_is_refused_naming_file_and_line(case, sts_model, tmp_path, capsys, monkeypatch):
    data = write_sts(tmp_path / "sts", n_pairs=10)
    line, says = BAD_LINES[case]
    with (data / "test.tsv").open("a") as f:
        f.write(line + "\n")
    err = _refuses([str(sts_model), "--data", str(data)], capsys, monkeypatch)
    assert f"{data / 'test.tsv'}:11: " in err and says in err


def test_missing_data_is_refused(sts_model, tmp_path, capsys, monkeypatch):
    err = _refuses([str(sts_model), "--data", str(tmp_path / "nowhere")], capsys, monkeypatch)
    assert f"--data {tmp_path / 'nowhere'}: no such directory" in err
    data = write_sts(tmp_path / "sts", n_pairs=10)
    (data / "dev.tsv").unlink()
    assert f"{data / 'dev.tsv'}: no such STS file" in _refuses([str(sts_model), "--data", str(data)], capsys,
                                                               monkeypatch)


def test_bad_flags_are_refused(sts_model, tmp_path, capsys):
    data = write_sts(tmp_path / "sts", n_pairs=10)
    with pytest.raises(SystemExit) as exit_info:
        sts.main([str(sts_model), "--data", str(data), "--pooling", "lasttoken"])
    assert exit_info.value.code == 2 and "--pooling" in capsys.readouterr().err
    assert sts.main([str(sts_model), "--data", str(data), "--bootstrap", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --bootstrap -1: out of range"


def test_converted_dir_without_its_tokenizer_is_refused(sts_model, tmp_path, capsys, monkeypatch):
    import shutil

    import transformers

    model = tmp_path / "hf"
    shutil.copytree(sts_model, model)
    for name in TOKENIZER_FILES:
        (model / name).unlink(missing_ok=True)
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("model loaded"))
    assert sts.main([str(model), "--data", str(write_sts(tmp_path / "sts", n_pairs=10))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: CONVERTED_DIR {model} has no tokenizer files") and "\n" not in err


def test_pooling_flag_overrides_the_declared_one(sts_model, tmp_path, capsys):
    data = write_sts(tmp_path / "sts", n_pairs=20)
    with recorded_embeddings() as seen:
        assert sts.main([str(sts_model), "--data", str(data), "--pooling", "cls", "--references", "--bootstrap", "0",
                         "--splits", "dev", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["pooling"]["mode"] == "cls" and record["pooling"]["source"] == "--pooling cls"
    pairs = sts.read_sts(data / "dev.tsv")
    cls_vectors = open_encoder(sts_model, pooling="cls").embed(pairs.first)
    np.testing.assert_allclose(seen["converted", tuple(pairs.first)], cls_vectors, rtol=0, atol=1e-5)
    assert not np.allclose(seen["converted", tuple(pairs.first)], open_encoder(sts_model).embed(pairs.first),
                           atol=1e-3)
    expected = scipy_spearman(model_cosines(seen, pairs), pairs.scores)
    assert record["splits"]["dev"]["model"]["spearman"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.skipif(not REAL_STSB.is_dir(), reason=f"{REAL_STSB}: the shared STS-B copy is not there")
def test_reads_the_real_sts_benchmark_as_it_is():
    sizes = {split: len(sts.read_sts(REAL_STSB / f"{split}.tsv")) for split in ("train", "dev", "test")}
    assert sizes == {"train": 5749, "dev": 1500, "test": 1379}
    test = sts.read_sts(REAL_STSB / "test.tsv")
    assert test.scores.min() >= 0 and test.scores.max() == 5 and test.first[0] == "a girl is styling her hair ."
