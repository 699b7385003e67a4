"""Issue 49 item 6: a converted directory whose tokenizer was swapped (600 entries; its config.json says
800) is refused by every tool that reads a converted directory, one line naming the directory and both
fingerprints, exit 2, before any compute. Before the fix `cpt-finetune` fine-tuned it and reported an
accuracy."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from pipeline.eval import sts
from pipeline.eval.finetune import main as finetune_main
from pipeline.tokenizer_checks import converted_tokenizer_problem, tokenizer_fingerprint
from tests.convert.test_finetune import write_keyword_task
from tests.eval.conftest import swap_tokenizer, write_sts


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("error: ")


def _names_both(message: str, model_dir, recorded: str, current: str) -> None:
    assert message.startswith(f"--model {model_dir}: " if message.startswith("--model") else
                              f"CONVERTED_DIR {model_dir}: "), message
    assert re.search(rf"fingerprint {current[:16]} now, conversion.tokenizer_fingerprint {recorded[:16]} in "
                     r"pipeline_meta.json", message), message


@pytest.fixture()
def swapped(sts_model, other_tokenizer_dir, tmp_path):
    model_dir = swap_tokenizer(sts_model, other_tokenizer_dir, tmp_path / "swapped")
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == 800
    assert len(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]) == 600
    recorded = json.loads((sts_model / "pipeline_meta.json").read_text())["conversion"]["tokenizer_fingerprint"]
    return model_dir, recorded, tokenizer_fingerprint(model_dir)


def test_conversion_records_the_tokenizer_it_wrote(sts_model, tmp_path):
    recorded = json.loads((sts_model / "pipeline_meta.json").read_text())["conversion"]["tokenizer_fingerprint"]
    assert recorded == tokenizer_fingerprint(sts_model) and converted_tokenizer_problem(sts_model, "--model") == ""
    copy = shutil.copytree(sts_model, tmp_path / "copy")  # a copy elsewhere is the same tokenizer
    (copy / "model.safetensors").unlink()  # only tokenizer files count
    assert tokenizer_fingerprint(copy) == recorded
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    assert converted_tokenizer_problem(copy, "--model")  # the casing of the text is part of it


def test_finetune_refuses_a_swapped_tokenizer(swapped, tmp_path, capsys, monkeypatch):
    import transformers

    model_dir, recorded, current = swapped
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **k: pytest.fail("fine-tuning started"))
    output = tmp_path / "result.json"
    code = finetune_main(["--model", str(model_dir), "--task-dir", str(write_keyword_task(tmp_path / "task", 32, 16)),
                          "--epochs", "1", "--output", str(output)])
    message = _one_line(capsys.readouterr().err)
    assert code == 2 and not output.exists()
    _names_both(message, model_dir, recorded, current)
    assert message.endswith("restore them or convert the checkpoint again; nothing was trained")


def test_sts_refuses_a_swapped_tokenizer(swapped, tmp_path, capsys, monkeypatch):
    import transformers

    model_dir, recorded, current = swapped
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("model loaded"))
    assert sts.main([str(model_dir), "--data", str(write_sts(tmp_path / "sts", n_pairs=10))]) == 2
    _names_both(_one_line(capsys.readouterr().err), model_dir, recorded, current)


def test_a_directory_converted_before_fingerprints_still_loads(sts_model, tmp_path):
    """No recorded fingerprint (an export of an older version, or a plain HF directory): nothing to compare."""
    copy = shutil.copytree(sts_model, tmp_path / "old")
    meta = json.loads((copy / "pipeline_meta.json").read_text())
    del meta["conversion"]["tokenizer_fingerprint"]
    (copy / "pipeline_meta.json").write_text(json.dumps(meta))
    assert converted_tokenizer_problem(copy, "--model") == ""
    (copy / "pipeline_meta.json").unlink()
    assert converted_tokenizer_problem(copy, "--model") == ""


def test_demo_outcome_refuses_a_swapped_tokenizer(sts_model, other_tokenizer_dir, tmp_path):
    from demo.outcome import load_demo

    out = tmp_path / "demo_output"
    (out / "hf").mkdir(parents=True)
    (out / "demo.json").write_text(json.dumps({"status": "done", "objective": "taco", "seq_len": 64}))
    shutil.copytree(sts_model, out / "hf" / "taco")
    assert load_demo(out, None) == (out / "hf" / "taco", 64)
    shutil.rmtree(out / "hf" / "taco")
    swap_tokenizer(sts_model, other_tokenizer_dir, out / "hf" / "taco")
    with pytest.raises(ValueError, match=rf"^demo output {re.escape(str(out / 'hf' / 'taco'))}: its tokenizer files"):
        load_demo(out, None)
