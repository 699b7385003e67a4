"""`SentenceTransformer(converted_dir)` loads offline and gives the project's own sentence embeddings:
the training model's encoder states (read from the checkpoint, not from the export) pooled as the
run's objective pools them in pretraining, on every objective and both families; `--pooling` chooses
another; a pooling the tokenizer cannot honour is refused; without the package the files are written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.export.convert import convert, main as convert_main
from pipeline.export.sentence_embedding import (SentencePooling, default_pooling, embed_states, pooling_problem,
                                                read_sentence_config)
from pipeline.pretrain.build import model_from_meta
from pipeline.train.checkpoint.tags import read_latest
from pipeline.train.run_meta import RunMeta
from tests.train.runs import module_state, run_inprocess

REPO = Path(__file__).resolve().parents[2]
#: preset -> (pooling, normalised): the sequence representation each objective reads in pretraining
#: (docs/conversion.md#sentence-transformers); tiny-infoword pools the mean and scores cosine.
EXPECTED = {"tiny-mlm": ("mean", False), "tiny-mlm-nce": ("mean", False), "tiny-taco": ("mean", False),
            "tiny-capt": ("cls", True), "tiny-cocolm": ("cls", True), "tiny-infoword": ("mean", True)}
FAMILIES = {"bert": (), "modernbert": ("model.arch=modernbert",)}
SENTENCES = ["Return a new list containing all items from the iterable.", "The file is closed.",
             "a", " ".join(["the iterator yields each value of the sequence in turn"] * 12)]  # longer than 64 tokens


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_shards_dir):
    """`runs(preset, family) -> run dir`: 3 training steps, once per module."""
    base = tmp_path_factory.mktemp("st_runs")
    cache: dict[tuple[str, str], Path] = {}

    def get(preset: str, family: str) -> Path:
        if (preset, family) not in cache:
            out = base / f"{preset}-{family}"
            assert run_inprocess(preset, tiny_shards_dir, out, "train.total_steps=3", "train.checkpoint_every=3",
                                 *FAMILIES[family]) == 0
            cache[preset, family] = out
        return cache[preset, family]

    return get


def own_embeddings(run: Path, tokenizer_dir: Path, pooling: SentencePooling) -> torch.Tensor:
    """The training model's encoder states on SENTENCES (the run's own tokenizer), pooled by the project."""
    from transformers import AutoTokenizer

    tag = read_latest(run / "checkpoints")
    model = model_from_meta(RunMeta.read(tag))
    model.load_state_dict(module_state(tag), strict=False)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    batch = tokenizer(SENTENCES, padding=True, truncation=True, max_length=pooling.max_seq_length, return_tensors="pt")
    with torch.no_grad():
        hidden = model.bert(batch["input_ids"], batch["attention_mask"]).last_hidden
    return embed_states(hidden, batch["attention_mask"], pooling)


def st_encode(directory: Path, monkeypatch) -> tuple[object, torch.Tensor]:
    st = pytest.importorskip("sentence_transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = st.SentenceTransformer(str(directory), device="cpu", local_files_only=True)
    return model, torch.from_numpy(model.encode(SENTENCES, batch_size=3, convert_to_numpy=True))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", EXPECTED)
def test_sentence_transformers_gives_the_projects_embeddings(preset, family, runs, tiny_shards_dir, tmp_path,
                                                             monkeypatch):
    run = runs(preset, family)
    out = convert(run, tmp_path / "hf")
    meta = json.loads((out / "pipeline_meta.json").read_text())
    declared = read_sentence_config(out)
    assert (declared.mode, declared.normalize) == EXPECTED[preset]
    assert meta["conversion"]["sentence_embedding"]["mode"] == declared.mode
    assert meta["conversion"]["sentence_embedding"]["source"].split(":")[0].count(preset.removeprefix("tiny-")) == 1
    assert declared.max_seq_length == meta["encoder_config"]["max_position"]

    model, encoded = st_encode(out, monkeypatch)
    assert model.max_seq_length == declared.max_seq_length
    assert type(model[0].auto_model).__name__ == ("ModernBertModel" if family == "modernbert" else "BertModel")
    ours = own_embeddings(run, tiny_shards_dir / "tokenizer", declared)
    torch.testing.assert_close(encoded, ours, rtol=0, atol=2e-5)
    assert ours.abs().max() > 0.05 and (ours[0] - ours[1]).abs().max() > 1e-3  # not constant vectors
    if declared.normalize:
        torch.testing.assert_close(encoded.norm(dim=1), torch.ones(len(SENTENCES)))


@pytest.mark.parametrize("flags, mode, normalize", [(["--pooling", "max", "--no-normalize"], "max", False),
                                                    (["--pooling", "cls", "--normalize"], "cls", True)])
def test_pooling_flag_chooses_another(flags, mode, normalize, runs, tiny_shards_dir, tmp_path, monkeypatch, capsys):
    run = runs("tiny-taco", "bert")
    assert convert_main([str(run), str(tmp_path / "hf"), *flags]) == 0
    declared = read_sentence_config(tmp_path / "hf")
    assert (declared.mode, declared.normalize) == (mode, normalize)
    record = json.loads((tmp_path / "hf" / "pipeline_meta.json").read_text())["conversion"]["sentence_embedding"]
    assert record["source"].startswith(" ".join(flags[:2])) and "run's own: mean" in record["source"]
    _, encoded = st_encode(tmp_path / "hf", monkeypatch)
    torch.testing.assert_close(encoded, own_embeddings(run, tiny_shards_dir / "tokenizer", declared), rtol=0, atol=2e-5)


def test_unknown_pooling_is_refused_naming_the_flag(runs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convert_main([str(runs("tiny-mlm", "bert")), str(tmp_path / "hf"), "--pooling", "lasttoken"])
    assert exit_info.value.code == 2 and "--pooling" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_cls_pooling_needs_a_cls_token_first(tiny_tokenizer_dir):
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    cls_pooling = SentencePooling("cls", False, "test")
    assert pooling_problem(cls_pooling, tokenizer) == ""
    sep = tokenizer.sep_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {sep}", pair=f"$A {sep} $B {sep}", special_tokens=[(sep, tokenizer.sep_token_id)])
    problem = pooling_problem(cls_pooling, tokenizer)
    assert problem.startswith("--pooling cls: the tokenizer does not put a [CLS] token first") and "\n" not in problem
    assert pooling_problem(SentencePooling("mean", False, "test"), tokenizer) == ""


def test_default_pooling_follows_the_objectives():
    assert default_pooling({"mlm": 1.0}, {}).mode == "mean"
    assert (default_pooling({"mlm": 1.0, "capt": 0.1}, {}).mode, default_pooling({"capt": 1.0}, {}).normalize) == \
        ("cls", True)
    paper = default_pooling({"infoword": 1.0}, {})  # the paper's recipe: [CLS], dot product
    assert (paper.mode, paper.normalize) == ("cls", False)
    tiny = default_pooling({"infoword": 1.0}, {"infoword": {"pool": "mean", "score": "cosine", "center": True}})
    assert (tiny.mode, tiny.normalize) == ("mean", True) and "excludes [CLS]/[SEP]" in tiny.source
    # several sequence objectives: the largest weight, ties in the order capt, cocolm, infoword
    both = {"infoword": 1.0, "capt": 0.5}
    assert default_pooling(both, {"infoword": {"pool": "mean"}}).source.startswith("infoword")
    assert default_pooling({"infoword": 1.0, "cocolm": 1.0}, {"infoword": {"pool": "mean"}}).mode == "cls"


def test_files_are_written_without_sentence_transformers(runs, tmp_path):
    """A conversion in a process where `import sentence_transformers` fails still writes every file."""
    run, out = runs("tiny-capt", "bert"), tmp_path / "hf"
    code = ("import sys; sys.modules['sentence_transformers'] = None\n"
            "from pipeline.export.convert import main\n"
            f"sys.exit(main([{str(run)!r}, {str(out)!r}]))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("modules.json", "0_Transformer/sentence_bert_config.json", "config_sentence_transformers.json",
                 "0_Transformer/model.safetensors", "1_Pooling/config.json"):
        assert (out / name).is_file(), name
    assert (out / "2_Normalize").is_dir()
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"] for m in modules] == ["sentence_transformers.models.Transformer",
                                            "sentence_transformers.models.Pooling",
                                            "sentence_transformers.models.Normalize"]
    pooling = json.loads((out / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_cls_token"] is True and pooling["word_embedding_dimension"] == 64
    assert sum(v is True for k, v in pooling.items() if k.startswith("pooling_mode")) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_sentence_transformers_loads_the_export_without_a_load_report(family, runs, tmp_path):
    """Issue 58: `SentenceTransformer(dir)` printed transformers' load report (the MLM head's keys unexpected,
    BERT's pooler missing and newly initialised). The Transformer module is `0_Transformer/`, an AutoModel
    checkpoint of the encoder alone: a load in a fresh process says nothing of keys, on stderr or as a warning."""
    pytest.importorskip("sentence_transformers")
    out = convert(runs("tiny-mlm", family), tmp_path / "hf")
    code = ("import warnings, logging; warnings.simplefilter('always'); logging.captureWarnings(True)\n"
            "from sentence_transformers import SentenceTransformer\n"
            f"m = SentenceTransformer({str(out)!r}, device='cpu', local_files_only=True)\n"
            "print(type(m[0].auto_model).__name__, m.encode(['a b']).shape)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "info"}  # every report transformers has, not only its warnings
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == ("ModernBertModel" if family == "modernbert" else "BertModel")
    for word in ("LOAD REPORT", "UNEXPECTED", "MISSING", "newly initialized", "not used", "Warning"):
        assert word not in proc.stderr, proc.stderr[-3000:]
    state = json.loads((out / "0_Transformer" / "config.json").read_text())
    assert state["architectures"] == [("ModernBertModel" if family == "modernbert" else "BertModel")]
    from safetensors import safe_open

    with safe_open(str(out / "0_Transformer" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(k.startswith(("cls.", "head.", "decoder.", "pooler.")) for k in keys)
