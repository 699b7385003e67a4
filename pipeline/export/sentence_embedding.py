"""The sentence-transformers configuration of a converted directory: which pooled state stands for a
sentence, and the files that make `SentenceTransformer(dir)` load it as it is (offline, no remote code).

Files (the classic layout every sentence-transformers release since 2.x reads; 6.x reads it silently):

    modules.json                       0: Transformer (0_Transformer/), 1: Pooling[, 2: Normalize]
    config_sentence_transformers.json  similarity_fn_name cosine
    0_Transformer/                     the encoder alone as an `AutoModel` checkpoint (BertModel without its
                                       pooler, ModernBertModel), its tokenizer, and sentence_bert_config.json
                                       (max_seq_length: the model's position table; do_lower_case false;
                                       model_args add_pooling_layer false for BERT)
    1_Pooling/config.json              word_embedding_dimension, pooling_mode_* (one true)
    2_Normalize/                       only when the objective's representation is compared by cosine

Why a folder of its own: the directory's root holds the `*ForMaskedLM` checkpoint (the MLM head, what
fill-mask and `AutoModelForMaskedLM` load), and `AutoModel` reading it reports the head's weights as
unexpected (`cls.predictions.*`, `head.*`, `decoder.bias`) and BERT's pooler, never trained by any of
these objectives, as missing and newly initialised. `SentenceTransformer(dir)` loads the encoder from
`0_Transformer/` instead, whose keys are exactly `AutoModel`'s (no pooler: sentence-transformers pools
the token states, never the pooler's output), so the load reports nothing. The cost: a second copy of
the encoder's weights on disk (the root keeps its own for the masked-LM head).

The pooling (`default_pooling`): the sequence representation the run's own objective reads in
pretraining, stripped of its training head; `cpt-convert --pooling` chooses another.

    capt      [CLS]: CAPT's s = l2_normalize(A(h_[CLS])) (Luo et al. 2021, Eq. 1; A the "aggregation
              layer", Sec. 3.1). *Choice*: h_[CLS] without A. A exists for the pretraining loss (it is
              exported among the objective heads, not in the encoder), as SimCLR's projection head g,
              whose input represents better than its output (Chen et al. 2020, Sec. 4.2: +10% linear
              evaluation); normalised (the contrast is between l2-normalised vectors).
    cocolm    [CLS]: SCL's head (Linear -> GELU -> LayerNorm) reads h_[CLS] (Meng et al. 2021, Sec. 3.2);
              the head is a training head as A is; normalised (SCL scores cosine / tau).
    infoword  `objective_options.infoword.pool`: "cls" (the paper's g, Kong et al. 2020, Sec. 4) or
              "mean" (footnote 4); normalised when `score: cosine`. Differences, stated: the objective's
              mean excludes [CLS] / [SEP], the exported mean (sentence-transformers' only mean) averages
              every attended position, the two specials included; `center: true` subtracts the
              micro-batch's mean row, which no single-sentence encoder can do.
    mlm, mlm-nce, taco   no sequence representation: mean over the attended positions, unnormalised.

A run with several of them uses the one of largest objective weight (ties: the order above).

The project's own pooled representation is `pool(hidden, attention_mask, mode)`, defined as
sentence-transformers' `Pooling` computes it: "mean" averages every position of the attention mask,
[CLS] and [SEP] included (`tests/convert/test_sentence_transformers.py` checks `encode` against the
training model's states pooled by it, both families, every objective).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

#: Poolings a converted directory can be given (sentence-transformers' names).
POOLINGS = ("cls", "mean", "max")
#: Objectives whose pretraining reads one sequence representation, in tie-break order.
SEQUENCE_OBJECTIVES = ("capt", "cocolm", "infoword")
MODULES_FILE = "modules.json"
ST_CONFIG_FILE = "sentence_bert_config.json"
ST_MODEL_CONFIG_FILE = "config_sentence_transformers.json"
TRANSFORMER_DIR, POOLING_DIR, NORMALIZE_DIR = "0_Transformer", "1_Pooling", "2_Normalize"
#: The key of the export's pipeline_meta.json that records the choice (and why).
META_KEY = "sentence_embedding"
#: Pooling config keys of sentence-transformers 2.x-5.x (6.x maps them to `pooling_mode`).
_LEGACY_MODE_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
                     "max": "pooling_mode_max_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
                     "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}


@dataclass(frozen=True)
class SentencePooling:
    """How a converted directory turns token states into one sentence vector."""

    mode: str  # one of POOLINGS
    normalize: bool  # l2-normalise the pooled vector (sentence-transformers' Normalize module)
    source: str  # why: the objective whose representation it is, or the flag that chose it
    max_seq_length: int = 0  # tokens per sentence (0: not set yet)

    def record(self) -> dict[str, Any]:
        return asdict(self)


def default_pooling(objectives: Mapping[str, float], options: Mapping[str, Mapping[str, Any]]) -> SentencePooling:
    """The pooling of the run's own sequence representation (module docstring), from the meta's
    `objectives` (name -> weight) and `objective_options`."""
    present = [name for name in SEQUENCE_OBJECTIVES if name in objectives]
    if not present:
        names = "+".join(sorted(objectives)) or "none"
        return SentencePooling("mean", False, f"{names}: no sequence representation in pretraining; mean over "
                                              "the attended positions ([CLS] and [SEP] included)")
    name = max(present, key=lambda n: (float(objectives[n]), -SEQUENCE_OBJECTIVES.index(n)))
    if name == "capt":
        return SentencePooling("cls", True, "capt: h_[CLS], the input of CAPT's aggregation layer A (a training "
                                            "head, not exported in the encoder); l2-normalised as CAPT's s")
    if name == "cocolm":
        return SentencePooling("cls", True, "cocolm: h_[CLS], the input of the SCL head (a training head); "
                                            "l2-normalised as SCL's cosine")
    opts = options.get("infoword", {}) or {}
    pool, cosine = str(opts.get("pool", "cls")), str(opts.get("score", "dot")) == "cosine"
    note = (" (the objective's mean excludes [CLS]/[SEP]" + (" and is centred over the micro-batch" if
            opts.get("center") else "") + "; sentence-transformers' mean includes them)") if pool == "mean" else ""
    return SentencePooling(pool, cosine, f"infoword: pool={pool}, score={'cosine' if cosine else 'dot'}{note}")


def chosen_pooling(objectives: Mapping[str, float], options: Mapping[str, Mapping[str, Any]],
                   mode: Optional[str], normalize: Optional[bool]) -> SentencePooling:
    """`default_pooling`, with `--pooling` / `--normalize` (when given) in its place."""
    default = default_pooling(objectives, options)
    if mode is None and normalize is None:
        return default
    if mode is not None and mode not in POOLINGS:
        raise ValueError(f"--pooling {mode}: not one of {', '.join(POOLINGS)}")
    chosen = []
    if mode is not None:
        chosen.append(f"--pooling {mode}")
    if normalize is not None:
        chosen.append("--normalize" if normalize else "--no-normalize")
    return SentencePooling(mode or default.mode, default.normalize if normalize is None else normalize,
                           f"{', '.join(chosen)} (the run's own: {default.mode}"
                           f"{', normalised' if default.normalize else ''}; {default.source})")


def pooling_problem(pooling: SentencePooling, tokenizer) -> str:
    """'' when `tokenizer` lets the model honour `pooling`, else why not (naming the flag)."""
    if pooling.mode != "cls":
        return ""
    cls_id = getattr(tokenizer, "cls_token_id", None)
    ids = tokenizer("a")["input_ids"]
    if cls_id is None or not ids or ids[0] != cls_id:
        first = tokenizer.convert_ids_to_tokens(ids[:1]) if ids else []
        return (f"--pooling cls: the tokenizer does not put a [CLS] token first (it starts a sentence with {first}, "
                f"cls_token_id={cls_id}), so the first state is a word's; use --pooling mean")
    return ""


def pool(hidden: Tensor, attention_mask: Tensor, mode: str) -> Tensor:
    """One vector per row of hidden [B, L, H], as sentence-transformers' `Pooling` computes it:

        cls:  h_f, f = the first attended position (position 0 with right padding)
        mean: sum_t m_t h_t / max(1e-9, sum_t m_t)        (m = attention_mask: [CLS] and [SEP] included)
        max:  max_t over the attended positions of h_t
    """
    mask = attention_mask.to(hidden.dtype)[..., None]
    if mode == "cls":
        first = attention_mask.to(torch.int).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0]), first]
    if mode == "mean":
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if mode == "max":
        return hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    raise ValueError(f"pooling {mode!r}: not one of {POOLINGS}")


def embed_states(hidden: Tensor, attention_mask: Tensor, pooling: SentencePooling) -> Tensor:
    """`pool`, then l2-normalised when `pooling.normalize` (as sentence-transformers' Normalize: eps 1e-12)."""
    vectors = pool(hidden, attention_mask, pooling.mode)
    return torch.nn.functional.normalize(vectors, p=2, dim=1) if pooling.normalize else vectors


def write_sentence_config(directory: Path, pooling: SentencePooling, hidden_size: int, tokenizer) -> None:
    """The files of the module docstring, into `directory`, whose root already holds the export's config.json,
    weights and tokenizer (`0_Transformer/` is made from them: `write_encoder_module`)."""
    modules = [{"idx": 0, "name": "0", "path": TRANSFORMER_DIR, "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"}]
    if pooling.normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": "sentence_transformers.models.Normalize"})
    model_args = write_encoder_module(directory, directory / TRANSFORMER_DIR, tokenizer)
    _write_json(directory / MODULES_FILE, modules)
    _write_json(directory / TRANSFORMER_DIR / ST_CONFIG_FILE, {"max_seq_length": pooling.max_seq_length,
                                                              "do_lower_case": False, "model_args": model_args})
    _write_json(directory / ST_MODEL_CONFIG_FILE, {"prompts": {}, "default_prompt_name": None,
                                                   "similarity_fn_name": "cosine"})
    config: dict[str, Any] = {"word_embedding_dimension": hidden_size}
    config.update({key: mode == pooling.mode for mode, key in _LEGACY_MODE_KEYS.items()})
    config["include_prompt"] = True
    (directory / POOLING_DIR).mkdir(parents=True, exist_ok=True)
    _write_json(directory / POOLING_DIR / "config.json", config)
    if pooling.normalize:
        (directory / NORMALIZE_DIR).mkdir(parents=True, exist_ok=True)


def write_encoder_module(root: Path, into: Path, tokenizer) -> dict[str, Any]:
    """The encoder of the `*ForMaskedLM` checkpoint in `root` as an `AutoModel` checkpoint in `into` (with the
    tokenizer), written by transformers itself: loaded with `AutoModel` and saved. BERT's pooler is left out
    (`add_pooling_layer=False`); the returned `model_args` make the load by sentence-transformers do the same."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    model_args = {"add_pooling_layer": False} if config.model_type == "bert" else {}
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # reading the encoder out of the masked-LM checkpoint: the head is left behind
    hf_logging.disable_progress_bar()  # its "Loading weights" / "Writing model shards" bars: not the user's concern
    try:
        encoder = AutoModel.from_pretrained(str(root), config=config, local_files_only=True, **model_args)
        encoder.save_pretrained(str(into))
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(str(into))
    return model_args


def read_sentence_config(directory: Path) -> Optional[SentencePooling]:
    """The pooling a converted directory declares (None when it has no modules.json), in either
    sentence-transformers layout (2.x-5.x `pooling_mode_*` flags, 6.x `pooling_mode`). A declaration
    this project cannot compute (a concatenation of modes, a mode outside POOLINGS, another module)
    is a ValueError naming the file."""
    modules_file = directory / MODULES_FILE
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
        pooling_dir = next(m["path"] for m in modules if str(m["type"]).endswith("Pooling"))
        pooling_path = directory / pooling_dir / "config.json"
        config = json.loads(pooling_path.read_text())
        transformer_dir = next(m.get("path", "") for m in modules if str(m["type"]).endswith("Transformer"))
        st_file = directory / transformer_dir / ST_CONFIG_FILE  # "": the root (directories converted before)
        st_config = json.loads(st_file.read_text()) if st_file.is_file() else {}
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as err:
        raise ValueError(f"{modules_file}: not a sentence-transformers layout this project reads "
                         f"(Transformer, Pooling[, Normalize]): {type(err).__name__}: {err}") from err
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ValueError(f"{modules_file}: modules {kinds}; this project computes Transformer, Pooling[, Normalize]")
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [m for m, key in _LEGACY_MODE_KEYS.items() if config.get(key)] or ["mean"]
        mode = mode[0] if len(mode) == 1 else mode
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in POOLINGS:
        raise ValueError(f"{pooling_path}: pooling {mode!r}; this project computes one of {', '.join(POOLINGS)}")
    return SentencePooling(str(mode), kinds[-1] == "Normalize", f"{modules_file}",
                           int(st_config.get("max_seq_length") or 0))


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
