"""BERT-style encoder with Hugging Face BERT parameter names (the heads are in `pipeline.model.heads`).

Parameter names follow `transformers.BertForMaskedLM` (`bert.embeddings.*`, `bert.encoder.layer.N.*`,
`cls.predictions.*`) with one exception: Q, K and V are one fused projection
`attention.self.qkv` ([3H, H] weight: the query rows, then key, then value), so the three
projections are one GEMM. Every boundary speaks Hugging Face names: `split_qkv` / `fuse_qkv` here
are the one home of that mapping (used by `pipeline.model.hf_names.to_hf` / `from_hf`, hence by
conversion, the COCO-LM generator export and warm starts).

Attention uses `torch.nn.functional.scaled_dot_product_attention`; which path a pass takes (no
mask, so SDPA can pick the flash kernel; unpadded variable-length attention; or the masked
reference) is decided on the host by `pipeline.model.attention`. `BertLayerStack.compile_layers`
wraps each layer in `torch.compile` (`model.compile=true`): regional compilation, one graph per
layer, which fuses the elementwise work (bias + GELU, dropout + residual + LayerNorm).
The encoder returns both the last hidden state and the embedding-layer output, because TACO's
global bias `g = h - e` needs the latter and keeping it costs nothing extra (it is saved for
backward anyway).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Mapping, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.model.attention import (ATTENTION_MODES, VarlenLayout, attention_backends, plan_attention,
                                      varlen_attention)
from pipeline.model.checkpointing import is_checkpointed, run_layer

#: What a layer receives about attention: nothing (dense), an additive bias (masked) or a layout (varlen).
LayerAttention = Optional[Union[Tensor, VarlenLayout]]


@dataclass(frozen=True)
class EncoderConfig:
    """Shape of a BERT encoder. `vocab_size` and `max_position` normally come from the shard manifest."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_size: int = 3072
    max_position: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    #: E, the width of the token / position / type embeddings (ELECTRA's `embedding_size`, Clark et al. 2020,
    #: Table 6: 128 for ELECTRA-Small under a hidden size of 256); None: the hidden size, one width throughout.
    embedding_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.embedding_size is not None and (type(self.embedding_size) is not int or self.embedding_size <= 0):
            raise ValueError(f"model.embedding_size={self.embedding_size!r}: must be a positive integer (or unset: "
                             "the hidden size)")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")

    @property
    def embedding_width(self) -> int:
        """E: `embedding_size`, or the hidden size H when it is unset."""
        return self.embedding_size or self.hidden_size

    @property
    def factorised(self) -> bool:
        """E != H: the embeddings are projected E -> H (`BertEncoder.embeddings_project`) and the MLM head's
        transform maps H -> E before the tied projection."""
        return self.embedding_width != self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self)


#: Size presets (layers / hidden / heads / FFN). Paper recipes: TACO Table 5, CAPT Table 4, ELECTRA Table 6
#: (ELECTRA-Small's embeddings are 128 wide, projected to the hidden 256: `model.embedding_size: 128` in the
#: `electra-small` run preset), BERT.
SIZE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=2, ffn_size=128),
    "taco-small": dict(num_layers=4, hidden_size=512, num_heads=8, ffn_size=2048),
    "capt-small": dict(num_layers=6, hidden_size=256, num_heads=4, ffn_size=1024),
    "electra-small": dict(num_layers=12, hidden_size=256, num_heads=4, ffn_size=1024),
    "base": dict(num_layers=12, hidden_size=768, num_heads=12, ffn_size=3072),
    "large": dict(num_layers=24, hidden_size=1024, num_heads=16, ffn_size=4096),
}


def build_encoder_config(size: str, **overrides) -> EncoderConfig:
    """`EncoderConfig` from a size preset name plus explicit overrides (vocab, max length, ...)."""
    if size not in SIZE_PRESETS:
        raise ValueError(f"unknown model.size {size!r}; choose one of {sorted(SIZE_PRESETS)}")
    return replace(EncoderConfig(**SIZE_PRESETS[size]), **overrides)


class EncoderOutput(NamedTuple):
    last_hidden: Tensor  # [B, L, H]: h, the last layer
    embedding_output: Tensor  # [B, L, H]: e, word + position + type embeddings after LayerNorm (projected to H)


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout, all E = `cfg.embedding_width` wide
    (`transformers.ElectraEmbeddings` with `embedding_size`; `BertEmbeddings` when E = H)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        width = cfg.embedding_width
        self.word_embeddings = nn.Embedding(cfg.vocab_size, width, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position, width)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, width)
        self.LayerNorm = nn.LayerNorm(width, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None) -> Tensor:
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection (`qkv`: query, key, value rows)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)

    def forward(self, x: Tensor, attn: LayerAttention) -> Tensor:
        """x [B, L, H] with `attn` None or a [B, 1, 1, L] bias; or x [T, H] with a `VarlenLayout`."""
        p = self.attention_dropout if self.training else 0.0
        qkv = self.qkv(x)
        if isinstance(attn, VarlenLayout):
            tokens = x.shape[0]
            q, k, v = qkv.view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
            return varlen_attention(q, k, v, attn, p).reshape(tokens, -1)
        b, l, h = x.shape
        q, k, v = qkv.view(b, l, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, dropout_p=p)
        return out.transpose(1, 2).reshape(b, l, h)


class BertSelfOutput(nn.Module):
    """Projection + residual + LayerNorm (post-LN, as in BERT)."""

    def __init__(self, cfg: EncoderConfig, in_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, cfg.hidden_size)

    def forward(self, x: Tensor, attn: LayerAttention) -> Tensor:
        return self.output(self.self(x, attn), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.ffn_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.ffn_size)

    def forward(self, x: Tensor, attn: LayerAttention) -> Tensor:
        a = self.attention(x, attn)
        return self.output(self.intermediate(a), a)


class BertLayerStack(nn.Module):
    """`encoder.layer.N`: a stack of transformer layers (shared by the main model and COCO-LM's generator).

    `attention` is the `model.attention` mode (`pipeline.model.attention`); `last_work` holds the
    (tokens, sum of squared sequence lengths) the last pass really processed, for FLOP counting.
    """

    def __init__(self, cfg: EncoderConfig, num_layers: Optional[int] = None) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(num_layers or cfg.num_layers))
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.attention = "auto"
        self.last_work: tuple[int, int] = (0, 0)
        self.compiled = False
        #: `model.activation_checkpointing` as a period k: layers 0, k, 2k, ... recompute their activations
        #: in backward (`pipeline.model.checkpointing`); 0: none
        self.checkpoint_period = 0

    def compile_layers(self) -> None:
        """Run the layers through `torch.compile` (`model.compile=true`), one compiled function per
        shape class, each with its own dynamo cache (a code object of its own), so the classes do
        not evict each other or share dynamo's recompile limit:

          * dense passes ([B, L], no mask: packed rows, COCO-LM's crop): shapes the collator fixes;
            automatic dynamic shapes turn a dimension that does change (the crop width of a batch
            with a padded row) dynamic at its first change, so it costs one recompile, not one
            per width;
          * masked passes ([B, L] + bias: a view without `seqlens`, e.g. InfoWord's n-gram rows,
            whose count and bucketed width change per batch): batch and width marked dynamic;
          * varlen passes ([T, H] real tokens + layout): T and the layout's sizes dynamic.

        Layers are arguments of the compiled functions (parameters are graph inputs), so every layer
        of every stack with one shape class shares one graph. `pipeline.model.compile_watch` logs a
        warning when dynamo gives up on one (recompile limit) and runs it eagerly."""
        from pipeline.model.compile_watch import watch_eager_fallbacks

        watch_eager_fallbacks()
        self.compiled = True

    def forward(self, x: Tensor, attention_mask: Optional[Tensor], seqlens: Optional[Tensor] = None) -> Tensor:
        """x [B, L, H]; attention_mask [B, L] 1/0 or None; seqlens [B] host-side real-token counts."""
        plan = plan_attention(x, attention_mask, seqlens, self.attention, self.head_dim)
        self.last_work = (plan.tokens, plan.sum_sq)
        if plan.kind == "varlen":
            layout = plan.layout
            assert layout is not None
            hidden = x.reshape(-1, x.shape[-1]).index_select(0, layout.indices)  # [T, H]: real tokens only
            step = _compiled("varlen") if self.compiled else _varlen_step
            for i, layer in enumerate(self.layer):
                hidden = run_layer(step, layer, hidden, layout, checkpointed=is_checkpointed(i, self.checkpoint_period))
            out = hidden.new_zeros(x.shape[0] * x.shape[1], hidden.shape[-1]).index_copy(0, layout.indices, hidden)
            return out.view(x.shape[0], x.shape[1], -1)  # padding positions hold zeros
        if plan.bias is None:
            step = _compiled("dense") if self.compiled else _dense_step
            for i, layer in enumerate(self.layer):
                x = run_layer(step, layer, x, checkpointed=is_checkpointed(i, self.checkpoint_period))
            return x
        if self.compiled and not plan.static:  # sizes chosen per batch: one dynamic graph for all of them
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch._dynamo.maybe_mark_dynamic(x, 1)
            torch._dynamo.maybe_mark_dynamic(plan.bias, 0)
            torch._dynamo.maybe_mark_dynamic(plan.bias, 3)
        step = _compiled("masked") if self.compiled else _masked_step
        with attention_backends(plan):  # a shape that changes per batch: no per-shape cuDNN graphs
            for i, layer in enumerate(self.layer):
                x = run_layer(step, layer, x, plan.bias, checkpointed=is_checkpointed(i, self.checkpoint_period))
        return x


def _dense_step(layer: nn.Module, x: Tensor) -> Tensor:
    return layer(x, None)


def _masked_step(layer: nn.Module, x: Tensor, bias: Tensor) -> Tensor:
    return layer(x, bias)


def _varlen_step(layer: nn.Module, x: Tensor, layout: VarlenLayout) -> Tensor:
    return layer(x, layout)


_COMPILED: dict[str, Callable] = {}


def _compiled(kind: str) -> Callable:
    """The compiled step of a shape class (`BertLayerStack.compile_layers`): distinct code objects,
    hence distinct dynamo caches. `dynamic=None`: automatic dynamic shapes (a dimension becomes
    dynamic when it first changes); varlen passes change their token count every batch: dynamic.
    Made on first use, not at import: `torch.compile` pulls in dynamo and Triton, which must not be
    imported before a process decides how (the kernel tests switch Triton's interpreter on first)."""
    if not _COMPILED:
        _COMPILED.update(dense=torch.compile(_dense_step, dynamic=None),
                         masked=torch.compile(_masked_step, dynamic=None),
                         varlen=torch.compile(_varlen_step, dynamic=True))
    return _COMPILED[kind]


def configure_layer_stacks(model: nn.Module, attention: str = "auto", compile_layers: bool = False,
                           checkpoint_period: int = 0, stack_type: Optional[type] = None) -> int:
    """Set the attention mode and the activation-checkpointing period (`pipeline.model.checkpointing`)
    of every layer stack of `stack_type` in `model` (main encoder, generators; default `BertLayerStack`,
    `pipeline.model.arch.configure_stacks` passes the family's) and optionally compile their layers;
    returns how many stacks were configured."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"model.attention={attention!r}: choose one of {ATTENTION_MODES}")
    stacks = [m for m in model.modules() if isinstance(m, stack_type or BertLayerStack)]
    for stack in stacks:
        stack.attention = attention
        stack.checkpoint_period = checkpoint_period
        if compile_layers:
            stack.compile_layers()
    return len(stacks)


class BertEncoder(nn.Module):
    """`BertModel` without pooler: embeddings + layer stack. Keys match HF `bert.*` (fused QKV aside).

    Factorised embeddings (`cfg.factorised`, E != H; ELECTRA-Small, Clark et al. 2020, Table 6): the
    E-wide embeddings go through `embeddings_project` (Linear E -> H), where `transformers.ElectraModel`
    has its `embeddings_project`, before the layers: e = W_p LN(x_word + x_pos + x_type) + b_p. With E = H
    there is no projection and no parameter for it (the state dict is the unfactorised one)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.embeddings_project: Optional[nn.Linear] = (
            nn.Linear(cfg.embedding_width, cfg.hidden_size) if cfg.factorised else None)
        self.encoder = BertLayerStack(cfg)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        token_type_ids: Optional[Tensor] = None,
        seqlens: Optional[Tensor] = None,
    ) -> EncoderOutput:
        """`seqlens`: the host-side real-token count of every row (`pipeline.data.batch.seqlens_key`); it
        lets the attention path be chosen without a device sync. Without it, a mask means the
        masked reference path."""
        e = self.embeddings(input_ids, token_type_ids)
        if self.embeddings_project is not None:
            e = self.embeddings_project(e)
        return EncoderOutput(self.encoder(e, attention_mask, seqlens), e)


_QKV = "attention.self.qkv."
_SEPARATE = ("query", "key", "value")


def split_qkv(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Fused `...attention.self.qkv.{weight,bias}` -> Hugging Face's `...attention.self.{query,key,value}.*`
    (any prefix: the main encoder or a generator); other keys are copied. Row order: q, k, v."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        head, found, param = key.rpartition(_QKV)
        if found and param in ("weight", "bias"):
            for name, part in zip(_SEPARATE, value.chunk(3, dim=0)):
                out[f"{head}attention.self.{name}.{param}"] = part
        else:
            out[key] = value
    return out


def _separate_name(key: str) -> Optional[tuple[str, str, str]]:
    """`(prefix, query|key|value, weight|bias)` of a Hugging Face Q/K/V projection key, else None."""
    head, found, rest = key.rpartition("attention.self.")
    name, _, param = rest.partition(".")
    if found and name in _SEPARATE and param in ("weight", "bias"):
        return head, name, param
    return None


def fuse_qkv(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of `split_qkv`: each `...attention.self.{query,key,value}.*` triple becomes one
    `qkv` tensor (a dict that is already fused passes through unchanged). A triple with a member
    missing is an error naming it."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        parts = _separate_name(key)
        if parts is None:
            out[key] = value
            continue
        head, _, param = parts
        fused = f"{head}{_QKV}{param}"
        if fused in out:
            continue
        names = [f"{head}attention.self.{n}.{param}" for n in _SEPARATE]
        missing = [n for n in names if n not in state]
        if missing:
            raise KeyError(f"{key}: the fused QKV projection also needs {missing}")
        out[fused] = torch.cat([state[n] for n in names], dim=0)
    return out


def init_bert_weights(module: nn.Module, initializer_range: float) -> None:
    """BERT initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=initializer_range)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=initializer_range)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
