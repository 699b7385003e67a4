"""`model.*`: the encoder's shape and implementation switches, owned and validated here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from pipeline.config.checks import ConfigError, check_choice, did_you_mean
from pipeline.kernels import KERNEL_MODES
from pipeline.model.arch import ARCHS, AnyEncoderConfig
from pipeline.model.attention import ATTENTION_MODES
from pipeline.model.checkpointing import checkpoint_period
from pipeline.model.encoder import SIZE_PRESETS, EncoderConfig
from pipeline.model.modernbert import MODERNBERT_SIZES, ModernBertConfig

LAYERNORM_IMPLS = ("torch", "apex")
MLM_BIAS_INITS = ("zero", "unigram")
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "ffn_size")
#: `model.*` fields of the ModernBERT family only (None: the size preset's / HF's default).
MODERNBERT_FIELDS = ("local_attention", "global_attn_every_n_layers")


@dataclass
class ModelConfig:
    arch: str = "bert"
    """Encoder family (`pipeline.model.arch`): `bert` (the 2018 BERT architecture), or `modernbert`
    (`pipeline.model.modernbert`: rotary positions, GeGLU, pre-LN without biases, alternating global /
    sliding-window attention; converts to Hugging Face `ModernBertForMaskedLM`). Every objective runs on both."""
    size: str = "tiny"
    """Size preset: for `arch=bert` from `pipeline.model.encoder.SIZE_PRESETS` (tiny, taco-small, capt-small,
    base, large); for `arch=modernbert` from `pipeline.model.modernbert.MODERNBERT_SIZES` (tiny, small, base,
    large, large-24)."""
    num_layers: Optional[int] = None
    """Override of the preset's layer count."""
    hidden_size: Optional[int] = None
    """Override of the preset's hidden size."""
    num_heads: Optional[int] = None
    """Override of the preset's attention-head count."""
    ffn_size: Optional[int] = None
    """Override of the preset's feed-forward inner size."""
    embedding_size: Optional[int] = None
    """`arch=bert` only: E, the width of the token / position / type embeddings when it differs from the hidden
    size H (ELECTRA's factorised embeddings, Clark et al. 2020, Table 6: ELECTRA-Small embeds at 128 under a hidden
    256): the embeddings and their LayerNorm are E wide, a Linear E -> H (`embeddings_project`) feeds the layers,
    and the MLM head's transform maps H -> E before the tied projection. Default: the hidden size (no projection).
    Exports as `ElectraForPreTraining` / `ElectraForMaskedLM` (`embedding_size` in their config)."""
    max_position: Optional[int] = None
    """Position-embedding table size (ModernBERT: the longest row it accepts); default: the shards' `seq_len`."""
    local_attention: Optional[int] = None
    """`arch=modernbert` only: sliding-window width of the local layers (tokens attend to |i - j| <= w / 2;
    HF's `local_attention`); default: the size preset's (128 from base up)."""
    global_attn_every_n_layers: Optional[int] = None
    """`arch=modernbert` only: layer l attends globally when l % n == 0, else in the window; default 3."""
    dropout: float = 0.1
    """Hidden dropout probability."""
    attention_dropout: float = 0.1
    """Attention-probability dropout."""
    kernels: str = "auto"
    """Loss ops: `torch` (reference), `triton` (fused kernels, error if unusable), `auto` (Triton on CUDA)."""
    layernorm: str = "torch"
    """LayerNorm implementation: `torch`, or `apex` (NVIDIA apex FusedLayerNorm; GPU, optional extra)."""
    mlm_bias_init: str = "zero"
    """Initial vocabulary output biases (`cls.predictions` and an objective's own, e.g. COCO-LM's generator):
    `zero` (BERT), or `unigram`: the centred log of the training tokens' add-one frequencies, counted on a bounded,
    evenly spaced sample of shard rows (`pipeline.monitor.health.unigram_counts`). With zero biases the cheapest early
    loss drop is to bend every token's representation toward the frequency distribution, which at high learning
    rates collapses the encoder (issue 15's investigation); `unigram` starts the head there instead. A head trained
    only with sampled negatives (BERT-NCE, InfoWord) starts at its own context-free optimum, log p - log q (0 for
    the unigram negative pools; `pipeline.pretrain.build.context_free_head_bias`). Fresh starts only (not on resume;
    a warm start's own MLM head replaces it)."""
    init_from: Optional[str] = None
    """Warm start: a local Hugging Face BERT directory (config.json, weights, tokenizer). Its config.json
    gives the shape (`size` is ignored), its weights initialise `bert.*` and the MLM head at a fresh start
    (never on resume); the shards must be built with its tokenizer (`pipeline.model.warm_start`)."""
    attention: str = "auto"
    """Attention path (`pipeline.model.attention`): `auto` (no mask when the collator says nothing is padded,
    so SDPA can use flash; padded views unpadded to variable-length flash attention on a GPU, masked SDPA
    elsewhere), `varlen` (unpadded whenever padded, also on the CPU), `masked` (the reference: always an
    additive mask)."""
    compile: bool = False
    """`torch.compile` the encoder layers (regional; one compiled function per shape class: dense, masked,
    varlen, `BertLayerStack.compile_layers`): fuses the elementwise work. Compiles at start-up and at most
    twice more per shape class (seconds to minutes); the weights and the state dict are unchanged."""
    activation_checkpointing: str = "none"
    """Activation checkpointing of the encoder layers (`pipeline.model.checkpointing`), both families:
    `none`, `all` (every layer), or an integer k in 1..num_layers: layers 0, k, 2k, ... (of the encoder and of
    any generator stack). A checkpointed layer keeps only its input and recomputes its activations in backward
    (`torch.utils.checkpoint`, non-reentrant, RNG state preserved): the same gradients (bitwise on the CPU),
    less activation memory, ~1/3 more layer compute. Works with ZeRO 1/2/3, `model.compile` and varlen."""

    def check(self) -> None:
        """Stage-1 checks (the config alone)."""
        check_choice(self.arch, ARCHS, "model.arch")
        presets = self.size_presets()
        if self.size not in presets:
            raise ConfigError(f"model.size={self.size!r}: unknown for model.arch={self.arch}"
                              f"{did_you_mean(self.size, list(presets))}; choose one of {sorted(presets)}")
        self.check_embedding_size()
        for name in MODERNBERT_FIELDS:
            value = getattr(self, name)
            if value is not None and self.arch != "modernbert":
                raise ConfigError(f"model.{name}={value}: only for model.arch=modernbert")
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"model.{name}={value!r}: must be a positive integer")
        if self.arch == "modernbert" and self.layernorm == "apex":
            raise ConfigError("model.layernorm=apex: apex's FusedLayerNorm carries a bias, ModernBERT's norms have "
                              "none; use model.layernorm=torch with model.arch=modernbert")
        if self.local_attention is not None and self.local_attention % 2:
            raise ConfigError(f"model.local_attention={self.local_attention}: must be even (the window is "
                              "|i - j| <= local_attention / 2)")
        check_choice(self.kernels, KERNEL_MODES, "model.kernels")
        check_choice(self.layernorm, LAYERNORM_IMPLS, "model.layernorm")
        check_choice(self.attention, ATTENTION_MODES, "model.attention")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"model.compile={self.compile!r}: must be true or false")
        check_choice(self.mlm_bias_init, MLM_BIAS_INITS, "model.mlm_bias_init")
        # a warm start's depth is its config.json's, checked in `encoder_config`; here only the form of the value
        self.check_activation_checkpointing(self.shape()["num_layers"] if not self.init_from else 2**31)
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name}={getattr(self, name)}: must be in [0, 1)")
        for name in (*SHAPE_FIELDS, "max_position"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"model.{name}={value}: must be positive")
        shape = self.shape()
        if shape["hidden_size"] % shape["num_heads"]:
            raise ConfigError(f"model.hidden_size={shape['hidden_size']} is not divisible by "
                              f"model.num_heads={shape['num_heads']}")
        if self.arch == "modernbert" and (shape["hidden_size"] // shape["num_heads"]) % 2:
            raise ConfigError(f"model.hidden_size / model.num_heads = {shape['hidden_size'] // shape['num_heads']} "
                              "is odd; rotary position embeddings need an even head size")

    def check_embedding_size(self) -> None:
        """`embedding_size`: unset, or a positive integer for a BERT-family model trained from scratch."""
        value = self.embedding_size
        if value is None:
            return
        if type(value) is not int or value <= 0:
            raise ConfigError(f"model.embedding_size={value!r}: must be a positive integer (or unset: the hidden size)")
        if self.arch == "modernbert":
            raise ConfigError(f"model.embedding_size={value}: only for model.arch=bert (ModernBERT's embeddings have "
                              "the hidden size); drop it")
        if self.init_from:
            raise ConfigError(f"model.embedding_size={value}: a warm start (model.init_from) takes its shape from its "
                              "config.json, whose embeddings have the hidden size; drop it")

    def check_activation_checkpointing(self, num_layers: int) -> None:
        """`activation_checkpointing` is none / all / k with 1 <= k <= `num_layers` (the preset's depth with its
        override at stage 1; a warm start's config.json depth in `encoder_config`)."""
        try:
            checkpoint_period(self.activation_checkpointing, num_layers)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def check_device(self, cuda: bool) -> None:
        """Stage-2 checks: the switches this machine must support."""
        from pipeline.capabilities import apex_available, triton_usable

        if self.kernels == "triton" and not triton_usable("cuda" if cuda else "cpu"):
            raise ConfigError("model.kernels=triton needs Triton on a CUDA device (or TRITON_INTERPRET=1 for CPU "
                              "testing); use model.kernels=auto")
        if self.layernorm == "apex" and not (cuda and apex_available()):
            raise ConfigError("model.layernorm=apex needs NVIDIA apex (built from github.com/NVIDIA/apex, never the "
                              "PyPI package 'apex') on a GPU machine")

    def size_presets(self) -> dict[str, dict[str, int]]:
        return MODERNBERT_SIZES if self.arch == "modernbert" else SIZE_PRESETS

    def shape(self) -> dict[str, int]:
        """Layers / hidden / heads / FFN (ModernBERT: and its window): the size preset with this config's overrides."""
        fields = SHAPE_FIELDS + (MODERNBERT_FIELDS if self.arch == "modernbert" else ())
        return {**self.size_presets()[self.size], **{k: getattr(self, k) for k in fields if getattr(self, k) is not None}}

    def encoder_config(self, vocab_size: int, seq_len: int, special_tokens: Mapping[str, int]) -> AnyEncoderConfig:
        """The encoder this config describes for shards of `vocab_size` / `seq_len` (the one place a
        run's model shape is decided): the size preset with its overrides, or with `init_from` the
        base model's config.json."""
        if self.init_from:
            encoder = self._base_encoder_config(vocab_size, seq_len, special_tokens)
            self.check_activation_checkpointing(encoder.num_layers)  # the base model's depth
            return encoder
        max_position = self.max_position or seq_len
        if max_position < seq_len:
            raise ConfigError(f"model.max_position={max_position} < shard seq_len={seq_len}")
        fields: dict[str, Any] = dict(self.shape(), vocab_size=vocab_size, max_position=max_position,
                                      dropout=self.dropout, attention_dropout=self.attention_dropout,
                                      pad_token_id=special_tokens["pad"])
        if self.arch == "modernbert":
            return ModernBertConfig(**fields)
        return EncoderConfig(**fields, embedding_size=self.embedding_size)

    def _base_encoder_config(self, vocab_size: int, seq_len: int, special_tokens: Mapping[str, int]) -> AnyEncoderConfig:
        from pipeline.model.hf_names import HF_CONFIG_FIELDS
        from pipeline.model.warm_start import CONFIG_FILE, base_encoder_fields

        assert self.init_from
        base = base_encoder_fields(self.init_from, self.arch)
        where = f"{self.init_from}/{CONFIG_FILE}"
        extra = MODERNBERT_FIELDS if self.arch == "modernbert" else ()
        for name in (*SHAPE_FIELDS, "max_position", *extra):
            value = getattr(self, name)
            if value is not None and value != base[name]:
                raise ConfigError(f"model.{name}={value} disagrees with {HF_CONFIG_FIELDS.get(name, name)}={base[name]} in "
                                  f"{where}; a warm start takes its shape from config.json: drop the override")
        if base["max_position"] < seq_len:
            raise ConfigError(f"{where}: max_position_embeddings={base['max_position']} is shorter than the shards' "
                              f"seq_len={seq_len}; build shards with --seq-len {base['max_position']} or less")
        if base["vocab_size"] < vocab_size:
            raise ConfigError(f"{where}: vocab_size={base['vocab_size']} is smaller than the shards' vocabulary "
                              f"({vocab_size} tokens); build the shards with this model's tokenizer "
                              f"(`python -m data_prep.build_shards --tokenizer {self.init_from}`)")
        cls = ModernBertConfig if self.arch == "modernbert" else EncoderConfig
        return cls(**base, dropout=self.dropout, attention_dropout=self.attention_dropout,
                   pad_token_id=special_tokens["pad"])

    def check_init_from(self, manifest: Any, shards_dir: str, fresh_start: bool) -> None:
        """Stage-2 checks of `init_from` against the shards (and its weights, for a fresh start)."""
        if not self.init_from:
            return
        from pipeline.model.warm_start import check_base_model

        encoder = self.encoder_config(manifest.vocab_size, manifest.seq_len, manifest.special_tokens)
        check_base_model(self.init_from, manifest, shards_dir, encoder, fresh_start)
