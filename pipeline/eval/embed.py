"""Sentence embeddings of a converted directory, computed as `SentenceTransformer(dir).encode` computes
them, with `transformers` alone (sentence-transformers is an optional extra): the directory's
`AutoModel`, its tokenizer truncating at `max_seq_length`, then `pipeline.export.sentence_embedding.
embed_states` with the pooling its `modules.json` declares (a directory converted before it had one:
the pooling of the run's own objective from its `pipeline_meta.json`, else mean).

`open_encoder` checks everything before any forward pass, each failure one line naming the flag and the
directory (`ValueError`): no config.json, no tokenizer files, a tokenizer swapped since conversion
(`pipeline.tokenizer_checks.converted_tokenizer_problem`), a tokenizer larger than the embedding table,
unreadable weights, a pooling the directory declares that this project cannot compute.

Two references measured by the same code path (`pipeline.eval.sts`):
  * `random_init`: the same configuration with fresh weights (`AutoModel.from_config`, Hugging Face's
    initialisation, seeded), the same tokenizer and pooling;
  * `input_embeddings`: the mean of the input embedding rows of a sentence's content tokens (its
    tokens other than the tokenizer's special tokens), no encoder layers.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from pipeline.export.sentence_embedding import POOLINGS, SentencePooling, default_pooling, embed_states, \
    read_sentence_config
from pipeline.tokenizer_checks import converted_tokenizer_problem, no_tokenizer_message

#: Sentences per forward pass.
BATCH_SIZE = 64


@dataclass
class Encoder:
    """A converted directory ready to embed: model (eval mode), tokenizer, pooling."""

    directory: Path
    model: torch.nn.Module
    tokenizer: object
    pooling: SentencePooling
    weights: str = "converted"  # "converted" (the directory's), or "random_init <seed>" (`random_init`)

    def inputs(self, sentences: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tokenizer's batch, truncated at `max_seq_length`, with only the keys the model's forward takes
        (a ModernBERT takes no token_type_ids; sentence-transformers drops them the same way)."""
        batch = self.tokenizer(list(sentences), padding=True, truncation=True, max_length=self.pooling.max_seq_length,
                               return_tensors="pt")
        accepted = inspect.signature(self.model.forward).parameters
        return {k: v for k, v in batch.items() if k in accepted}

    @torch.no_grad()
    def embed(self, sentences: Sequence[str], batch_size: int = BATCH_SIZE,
              progress: Optional[Callable[[int], object]] = None) -> np.ndarray:
        """[N, H] float32 embeddings (sentence-transformers' `encode`, numpy output); `progress(n)` after each
        batch of n sentences."""
        out = []
        for start in range(0, len(sentences), batch_size):
            batch = self.inputs(sentences[start:start + batch_size])
            hidden = self.model(**batch).last_hidden_state
            out.append(embed_states(hidden, batch["attention_mask"], self.pooling).float().numpy())
            if progress is not None:
                progress(len(batch["attention_mask"]))
        return np.concatenate(out) if out else np.zeros((0, self.model.config.hidden_size), np.float32)

    @torch.no_grad()
    def mean_input_embeddings(self, sentences: Sequence[str]) -> np.ndarray:
        """[N, H]: the mean input embedding row of each sentence's content tokens (no specials)."""
        table = self.model.get_input_embeddings().weight.float()
        rows = [content_ids(self.tokenizer, s) for s in sentences]
        return torch.stack([table[torch.tensor(ids)].mean(0) if ids else torch.zeros(table.shape[1])
                            for ids in rows]).numpy()

    def random_init(self, seed: int) -> "Encoder":
        """The same configuration, tokenizer and pooling with weights drawn afresh (seeded)."""
        from transformers import AutoModel

        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = AutoModel.from_config(self.model.config).eval()
        finally:
            torch.random.set_rng_state(generator_state)
        return replace(self, model=model, weights=f"random_init {seed}")


def content_ids(tokenizer, sentence: str) -> list[int]:
    """The token ids of `sentence` without the tokenizer's special tokens."""
    return [int(i) for i in tokenizer(sentence, add_special_tokens=False)["input_ids"]]


def resolve_pooling(model_dir: Path, flag: str, override: Optional[str] = None) -> SentencePooling:
    """The directory's declared pooling (modules.json), else its run's own (pipeline_meta.json), else mean;
    `override` (`--pooling`) replaces the mode. max_seq_length: declared, else config.json's positions."""
    config = json.loads((model_dir / "config.json").read_text())
    positions = int(config.get("max_position_embeddings") or 512)
    try:
        declared = read_sentence_config(model_dir)
    except ValueError as err:
        raise ValueError(f"{flag} {err}") from err
    if declared is None:
        meta_file = model_dir / "pipeline_meta.json"
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        declared = (default_pooling(meta.get("objectives", {}), meta.get("objective_options", {})) if meta
                    else SentencePooling("mean", False, "no modules.json nor pipeline_meta.json: mean"))
    if override is not None:
        if override not in POOLINGS:
            raise ValueError(f"--pooling {override}: not one of {', '.join(POOLINGS)}")
        declared = replace(declared, mode=override, source=f"--pooling {override}")
    length = min(declared.max_seq_length or positions, positions)
    return replace(declared, max_seq_length=length)


def open_encoder(model_dir: str | Path, flag: str = "--model", pooling: Optional[str] = None) -> Encoder:
    """The converted directory's model, tokenizer and pooling, every check of the module docstring first."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from pipeline.export.sentence_embedding import pooling_problem
    from pipeline.model.warm_start import read_weight_shapes

    directory = Path(model_dir)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{flag} {directory}: no config.json (convert a checkpoint with cpt-convert first)")
    missing = no_tokenizer_message(directory)
    if missing:
        raise ValueError(f"{flag} {missing}; copy the run's tokenizer into it or convert the checkpoint again")
    swapped = converted_tokenizer_problem(directory, flag)
    if swapped:
        raise ValueError(swapped)
    chosen = resolve_pooling(directory, flag, pooling)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises many types for an unusable directory
        raise ValueError(f"{flag} {directory}: no tokenizer loadable ({type(err).__name__}: {err})") from err
    vocab = int(json.loads((directory / "config.json").read_text()).get("vocab_size", 0))
    if len(tokenizer) > vocab:
        raise ValueError(f"{flag} {directory}: its tokenizer has {len(tokenizer)} entries but config.json's vocab_size "
                         f"is {vocab}: not the model's tokenizer")
    problem = pooling_problem(chosen, tokenizer)
    if problem:
        raise ValueError(problem)
    try:
        read_weight_shapes(directory)  # a truncated weight file is named here, not by a safetensors traceback
    except Exception as err:
        raise ValueError(f"{flag} {err}") from err
    hf_logging.set_verbosity_error()  # "some weights not used" (the MLM head) is expected for AutoModel
    hf_logging.disable_progress_bar()  # its "Loading weights" bar: the commands draw their own
    model = AutoModel.from_pretrained(str(directory), local_files_only=True).eval()
    return Encoder(directory, model, tokenizer, chosen)
