"""What `cpt-convert` says when it is done: a few lines for a person (what was exported, from which step,
as which Hugging Face classes, how to load it, the sentence pooling; the health check's warning, when there is
one, went to stderr before them), or with `--json`
the one JSON object it always wrote (`summary`: the directory, its files and the export record's
`conversion` entry), read back from the finished directory so both describe what is on disk."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.train.run_meta import META_FILE  # standard library only: generator_record reads these names too

#: The key the export's `pipeline_meta.json` (and the printed summary) adds: what conversion changed
#: (`mlm_head_bias`: the NCE log-q correction of the MLM head, `hf_adapter.HeadBiasCorrection`) and
#: added (`tokenizer_fingerprint`, read by `tokenizer_checks.converted_tokenizer_problem`;
#: `sentence_embedding`, the sentence-transformers pooling and why).
CONVERSION_KEY = "conversion"
#: Where `--with-generator` writes the generator (COCO-LM's, ELECTRA's), inside the export (its fingerprint:
#: `pipeline.export.generator_record`).
GENERATOR_SUBDIR = "generator"


def _mapping(value: Any) -> dict:
    """`value` when it is a JSON object, else {}. The record is the checkpoint's own `pipeline_meta.json`
    (older runs wrote fewer fields, or other shapes) with `conversion` added: the export is already
    written when these lines are made, so an odd field must not turn a good export into a traceback and a
    non-zero exit code."""
    return value if isinstance(value, dict) else {}


def _meta(out: Path) -> dict[str, Any]:
    return _mapping(json.loads((out / META_FILE).read_text()))


def summary(out: Path) -> dict[str, Any]:
    """`{"out_dir", "files", **conversion}`: the machine-readable record `--json` prints."""
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    record = {"out_dir": str(out), "files": files}
    record.update(_mapping(_meta(out).get(CONVERSION_KEY)))
    return record


def _architectures(directory: Path) -> str:
    config = _mapping(json.loads((directory / "config.json").read_text()))
    names = config.get("architectures")
    return ", ".join(map(str, names)) if isinstance(names, list) and names else str(config.get("model_type", "?"))


def render(out: Path) -> str:
    """The person's lines: `exported ... to OUT (N files)`, the load line, pooling, health, generator."""
    from pipeline.export.sentence_embedding import TRANSFORMER_DIR  # torch: only when rendering

    meta = _meta(out)
    conversion = _mapping(meta.get(CONVERSION_KEY))
    names = meta.get("objectives")
    objectives = "+".join(sorted(map(str, names))) if isinstance(names, (dict, list)) and names else "?"
    preset = _mapping(meta.get("recipe")).get("preset")
    article = "an" if objectives[0] in "aeiou" else "a"  # "an electra run", "an infoword run"
    files = [p for p in out.rglob("*") if p.is_file()]
    lines = [f"exported step {meta.get('step', '?')} of {article} {objectives} run{f' ({preset})' if preset else ''} "
             f"to {out} ({len(files)} files) as {_architectures(out)}",
             f"  load with: transformers.{_architectures(out).split(', ')[0]}.from_pretrained({str(out)!r})"]
    if (out / TRANSFORMER_DIR / "config.json").is_file():  # the encoder alone loads without transformers' load report
        lines.append(f"  the encoder alone: transformers.AutoModel.from_pretrained({str(out / TRANSFORMER_DIR)!r})")
    if (out / "modules.json").is_file():
        lines.append(f"  sentence embeddings: sentence_transformers.SentenceTransformer({str(out)!r})")
    sentence = _mapping(conversion.get("sentence_embedding"))
    if sentence:
        norm = ", l2-normalised" if sentence.get("normalize") else ""
        lines.append(f"  sentence pooling: {sentence.get('mode', '?')}{norm} ({sentence.get('source', '')})"
                     .replace(" ()", ""))
    if "mlm_head_bias" in conversion:
        note = _mapping(conversion["mlm_head_bias"]).get("note", "corrected (see pipeline_meta.json)")
        lines.append(f"  MLM head bias: {note}")
    generator = out / GENERATOR_SUBDIR
    if (generator / "config.json").is_file():
        lines.append(f"  generator: {generator} as {_architectures(generator)}")
    lines.append(f"  model card: {out / 'README.md'}; the run's record: {out / META_FILE}")
    return "\n".join(lines)
