"""`checkpoints/README.md`: how to turn a run's DeepSpeed checkpoints into a Hugging Face model.

It lives here, beside the checkpoint writer (`pipeline.train.checkpoint.tags.write_conversion_readme`),
not in `pipeline.export` where the converter is: the text needs only the model families' names
(`pipeline.model.arch`, below both), and keeping it in the train package lets the writer complete a
checkpoints directory on its own without importing the export package above it (issue 48: no
import runs back up the layers). An injected renderer was the other way; it would leave every
caller of `save_checkpoint` (tests, benchmarks) to pass it, for a constant text.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.model.arch import FAMILY_TITLES, HF_MASKED_LM

README_FILE = "README.md"

CHECKPOINT_README = """# Checkpoints of a contrastive-pretrain run: {family} encoder (`model.arch={arch}`)

Each `step_*` directory is one DeepSpeed checkpoint (weights, optimizer state, `pipeline_meta.json`);
`latest` names the newest complete one. They hold the training model, not a Hugging Face model:
{training_names}, and the objectives' own heads are beside the encoder.

To get a Hugging Face `{hf_class}` directory (config, safetensors, tokenizer, model card):

    cpt-convert {run_dir} hf_model/          # the latest checkpoint; or name a step_* directory
    # (the same as: python -m pipeline.export.convert {run_dir} hf_model/)

Any ZeRO stage and rank count converts on a CPU. `zero_to_fp32.py` here is DeepSpeed's own helper:
it writes the training model's names, which `{hf_class}` does not load (and its
`--safe_serialization` stops on the tied embeddings). If you already ran it, convert its output:

    cpt-convert {run_dir}/checkpoints/step_XXXXXXXX hf_model/ --weights ZERO_TO_FP32_OUTPUT_DIR

`zero_to_torch.py` (DeepSpeed's second helper) does the same consolidation; its output converts the
same way when written with `--dtype float32` (a 16-bit output passes --weights' check, being the
tag's weights rounded, but the export then holds the rounded values).

To continue or extend the run: `cpt-train --resume {run_dir} train.total_steps=N`.
Details: docs/conversion.md and docs/training.md of the contrastive-pretrain repository.
"""
#: How the training model's names differ from the Hugging Face class's, per family (`model.arch`).
_TRAINING_NAMES = {
    "bert": "its attention has one fused `attention.self.qkv` projection where\n`BertForMaskedLM` has separate "
            "query, key and value",
    "modernbert": "its tensors are named `bert.*` / `cls.*` where\n`ModernBertForMaskedLM` has `model.*` / `head.*`",
}


def render_checkpoint_readme(checkpoints_dir: Path, arch: str) -> str:
    """The README of a run's checkpoints directory, naming the run's family (`model.arch`) and the
    Hugging Face class its checkpoints convert to."""
    return CHECKPOINT_README.format(run_dir=checkpoints_dir.resolve().parent, arch=arch, family=FAMILY_TITLES[arch],
                                    hf_class=HF_MASKED_LM[arch], training_names=_TRAINING_NAMES[arch])
