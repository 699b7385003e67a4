"""`cpt-convert`'s closing lines are made after the export is written: a record with missing or oddly shaped
fields (an older run's `pipeline_meta.json`, copied into the export) must still give the lines and the JSON,
never a traceback that turns a good export into a non-zero exit code."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.export.convert_report import render, summary


def _export(tmp_path: Path, meta: dict, config: object) -> Path:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    (out / "pipeline_meta.json").write_text(json.dumps(meta))
    return out


@pytest.mark.parametrize("meta", [
    {},  # an old export: none of the fields
    {"conversion": None, "objectives": None, "recipe": "tiny-mlm", "step": 3},
    {"conversion": {"mlm_head_bias": "corrected", "sentence_embedding": None}, "objectives": ["mlm"], "recipe": None},
    {"conversion": [], "objectives": {}, "recipe": {"preset": None}},
])
def test_odd_or_missing_record_fields_still_give_the_lines_and_the_json(tmp_path, meta):
    out = _export(tmp_path, meta, {"architectures": None, "model_type": "bert"})
    text = render(out)
    assert text.startswith(f"exported step {meta.get('step', '?')} of a ") and f"to {out} (2 files) as bert" in text
    assert "load with: transformers.bert.from_pretrained" in text
    record = summary(out)
    assert record["out_dir"] == str(out) and record["files"] == ["config.json", "pipeline_meta.json"]


def test_an_objective_with_a_vowel_reads_an(tmp_path):
    out = _export(tmp_path, {"objectives": {"electra": 1.0}, "step": 5}, {"architectures": ["ElectraForPreTraining"]})
    assert render(out).startswith("exported step 5 of an electra run to ")
