"""A ModernBERT-style encoder (Warner et al. 2024, "Smarter, Better, Faster, Longer: A Modern Bidirectional
Encoder for Fast, Memory Efficient, and Long Context Finetuning and Inference"), `model.arch=modernbert`.

The math is Hugging Face's `ModernBertModel` / `ModernBertForMaskedLM` (transformers 5.x), so a
checkpoint converts to that class with equal logits (`pipeline.export.modernbert_adapter`):

* embeddings: e = Dropout(LayerNorm(E[x])) — token embeddings only (no position or type table), the
  LayerNorm without bias (`norm_bias=False`);
* layer l (pre-LN, no biases anywhere by default):
      a = x + Dropout(W_o Attn(RoPE_l(W_qkv LN_attn(x))))      (LN_attn is the identity for l = 0)
      x' = a + W_o' Dropout(GELU(u) * g),  [u, g] = W_i LN_mlp(a)      (GeGLU, Shazeer 2020)
* attention: layer l is *global* when l % `global_attn_every_n_layers` == 0, else *local*: token i
  attends to j only if |i - j| <= `local_attention` // 2 (inclusive, HF's bidirectional sliding
  window); each kind has its own rotary base (`global_rope_theta`, `local_rope_theta`; Su et al. 2021,
  RoFormer): q_rot = q cos(p w) + rotate_half(q) sin(p w), w_k = theta^(-2k/d), p the position in the row;
* output: h = LayerNorm(x_L) (`final_norm`); the MLM head is LayerNorm(GELU(W h)) projected with the
  tied token embeddings plus an output bias (`decoder_bias`).

State-dict names reuse the training model's slots: the encoder is `bert.*` (`bert.embeddings.*`,
`bert.encoder.layers.N.*`, `bert.encoder.final_norm.*`) and the head `cls.predictions.*`, so every
objective, the unigram bias init and the NCE head correction see the same interface as with BERT
(`ctx.encoder(ids, mask, seqlens=...)` -> `EncoderOutput(h, e)`, `ctx.encoder.embeddings(ids)`,
`ctx.head(hidden, fn, ...)`, `ctx.head.predictions.decoder`). TACO's g = h - e uses e above.

Attention paths are chosen by `pipeline.model.attention.plan_attention` exactly as for BERT (dense /
masked / unpadded varlen). The sliding window is an additive mask on the dense and masked paths and on
the CPU varlen path (`pipeline.model.attention.repadded_attention`); on CUDA in half precision the local layers call the flash
kernel with `window_size_left = window_size_right = local_attention // 2` (unpadded or not).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.model.attention import (VarlenLayout, attention_backends, plan_attention, varlen_attention,
                                      varlen_layout, window_bias)
from pipeline.model.checkpointing import is_checkpointed, run_layer
from pipeline.model.encoder import EncoderOutput
from pipeline.model.heads import TiedVocabProjection

ARCH = "modernbert"
_HALF = (torch.float16, torch.bfloat16)
LayerAttention = Optional[Union[Tensor, VarlenLayout]]


@dataclass(frozen=True)
class ModernBertConfig:
    """Shape of a ModernBERT encoder (field names shared with `EncoderConfig` where they mean the same).

    `ffn_size` is HF's `intermediate_size` (the GeGLU's inner width; `Wi` is [2 ffn, hidden]);
    `dropout` is HF's `embedding_dropout` and `mlp_dropout`; `attention_dropout` is HF's (on the
    attention probabilities and the output projection); `max_position` only bounds the shards' rows."""

    vocab_size: int = 50368
    hidden_size: int = 768
    num_layers: int = 22
    num_heads: int = 12
    ffn_size: int = 1152
    max_position: int = 8192
    dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0
    pad_token_id: int = 0
    global_attn_every_n_layers: int = 3
    local_attention: int = 128
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    classifier_bias: bool = False
    arch: str = ARCH

    def __post_init__(self) -> None:
        if self.arch != ARCH:
            raise ValueError(f"ModernBertConfig.arch={self.arch!r}: must be {ARCH!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head size {self.hidden_size // self.num_heads} is odd; rotary embeddings need an even one")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size", "max_position",
                     "global_attn_every_n_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.local_attention < 2 or self.local_attention % 2:
            raise ValueError(f"model.local_attention={self.local_attention}: must be an even window of at least 2 "
                             "(tokens attend to |i - j| <= local_attention / 2)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window(self) -> int:
        """Half window: the largest |i - j| a local layer attends over."""
        return self.local_attention // 2

    @property
    def embedding_width(self) -> int:
        """The token embeddings' width: the hidden size (no factorised embeddings in this family;
        `EncoderConfig.embedding_width` is the BERT family's)."""
        return self.hidden_size

    @property
    def factorised(self) -> bool:
        return False

    def is_global(self, layer: int) -> bool:
        return layer % self.global_attn_every_n_layers == 0

    def to_dict(self) -> dict:
        return asdict(self)


#: Size presets of `model.arch=modernbert` (layers / hidden / heads / GeGLU width; window, global period).
#: base and large are ModernBERT's published shapes (Warner et al. 2024, Table 9 / the HF configs);
#: large-24 is large at BERT-large's depth (like-for-like with BERT-large); small / tiny are for the CPU.
MODERNBERT_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=3, hidden_size=64, num_heads=2, ffn_size=96, local_attention=16),
    "small": dict(num_layers=6, hidden_size=256, num_heads=4, ffn_size=384, local_attention=64),
    "base": dict(num_layers=22, hidden_size=768, num_heads=12, ffn_size=1152, local_attention=128),
    "large": dict(num_layers=28, hidden_size=1024, num_heads=16, ffn_size=2624, local_attention=128),
    "large-24": dict(num_layers=24, hidden_size=1024, num_heads=16, ffn_size=2624, local_attention=128),
}


def is_modernbert(config: object) -> bool:
    return isinstance(config, ModernBertConfig)


# ---- rotary embeddings and attention ---------------------------------------------------------------


def rotary_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [..., head_dim] of `positions` [...]: angle p * theta^(-2k/d), the d/2 frequencies twice
    (HF's layout: the first half of a head pairs with its second half). Computed in fp32 on the fly (a
    buffer would be cast to bf16 with the module and lose the high frequencies' precision)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] along the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., heads, D] rotated by cos / sin [..., D] (broadcast over heads), computed in fp32 like HF."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def window_pairs(length: int, window: int) -> int:
    """Number of (i, j) pairs with |i - j| <= window in a sequence of `length`: s (2w + 1) - w (w + 1)
    when s > w, else s^2 (every pair)."""
    if length <= window:
        return length * length
    return length * (2 * window + 1) - window * (window + 1)


# ---- modules (HF names: embeddings.{tok_embeddings,norm}, layers.N.{attn_norm,attn.{Wqkv,Wo},mlp_norm,mlp.{Wi,Wo}}) ---


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None) -> Tensor:
        """`token_type_ids` is accepted for the encoders' common call and ignored (no segment table)."""
        return self.drop(self.norm(self.tok_embeddings(input_ids)))


class ModernBertAttention(nn.Module):
    """Fused QKV (`Wqkv`, rows q, k, v), rotary positions, global or sliding-window attention, `Wo`."""

    def __init__(self, cfg: ModernBertConfig, is_global: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.window = None if is_global else cfg.window
        self.attention_dropout = cfg.attention_dropout
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.out_drop = nn.Dropout(cfg.attention_dropout)

    def forward(self, x: Tensor, attn: LayerAttention, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, L, H] with `attn` None or an additive [B|1, 1, L|1, L] bias, or x [T, H] / [B, L, H]
        with a `VarlenLayout` (the varlen kernel over the flattened tokens); cos / sin [..., D] per token."""
        p = self.attention_dropout if self.training else 0.0
        q, k, v = self.Wqkv(x).view(*x.shape[:-1], 3, self.num_heads, self.head_dim).unbind(-3)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if isinstance(attn, VarlenLayout):
            flat = [t.reshape(-1, self.num_heads, self.head_dim) for t in (q, k, v)]
            out = varlen_attention(*flat, attn, p, self.window).reshape(x.shape)
        else:
            out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                                 attn_mask=attn, dropout_p=p)
            out = out.transpose(-3, -2).reshape(x.shape)
        return self.out_drop(self.Wo(out))


class ModernBertMLP(nn.Module):
    """GeGLU: W_o Dropout(GELU(u) * g), [u, g] = W_i x (u the first half of W_i's rows)."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=cfg.mlp_bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.Wo = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        u, g = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.drop(F.gelu(u) * g))


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, index: int) -> None:
        super().__init__()
        self.is_global = cfg.is_global(index)
        # the embedding norm already normalised layer 0's input (HF: an identity there, no parameters)
        self.attn_norm = nn.Identity() if index == 0 else nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps,
                                                                       bias=cfg.norm_bias)
        self.attn = ModernBertAttention(cfg, self.is_global)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)
        self.mlp = ModernBertMLP(cfg)

    def forward(self, x: Tensor, attn: LayerAttention, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), attn, cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertLayerStack(nn.Module):
    """`layers.N` + `final_norm`: the main encoder's body and COCO-LM's generator (same call as
    `BertLayerStack`: `stack(x, attention_mask, seqlens)`, `attention` mode, `last_work`, `compile_layers`).
    The final LayerNorm belongs to the stack: a pre-LN stack's raw output is unnormalised."""

    def __init__(self, cfg: ModernBertConfig, num_layers: Optional[int] = None) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(num_layers or cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)
        self.attention = "auto"
        self.last_work: tuple[int, int] = (0, 0)
        self.last_flops = 0.0  # forward FLOPs of the last pass (`pass_flops`), read by the training metrics
        self._compiled: Optional[list[nn.Module]] = None  # a plain list: the state dict keeps its names
        self.checkpoint_period = 0  # `model.activation_checkpointing` as a period k (`pipeline.model.checkpointing`)

    def pass_flops(self, lengths: list[int]) -> float:
        """Forward FLOPs of the layers over sequences of `lengths` real tokens (Megatron's count with a
        GeGLU MLP and windowed local attention; see `pipeline.train.metrics`):

            sum_l [ 2 T (4 h^2 + 3 h f) + 4 h P_l ],   T = sum_b s_b,
            P_l = sum_b s_b^2 (global),  sum_b window_pairs(s_b, w) (local)."""
        cfg = self.config
        h, f, w = cfg.hidden_size, cfg.ffn_size, cfg.window
        tokens = float(sum(lengths))
        pairs = {True: float(sum(s * s for s in lengths)), False: float(sum(window_pairs(s, w) for s in lengths))}
        return sum(2.0 * tokens * (4 * h * h + 3 * h * f) + 4.0 * h * pairs[layer.is_global] for layer in self.layers)

    def compile_layers(self) -> None:
        """`torch.compile` every layer (static shapes); used on the passes whose shape the collator fixes."""
        self._compiled = [torch.compile(layer, dynamic=False) for layer in self.layers]

    def forward(self, x: Tensor, attention_mask: Optional[Tensor], seqlens: Optional[Tensor] = None) -> Tensor:
        """x [B, L, H] (the embedding output); attention_mask [B, L] 1/0 or None; seqlens [B] host-side
        real-token counts. Returns the final-normed states [B, L, H] (zeros at padding on the varlen path)."""
        cfg = self.config
        batch, length = x.shape[0], x.shape[1]
        plan = plan_attention(x, attention_mask, seqlens, self.attention, cfg.head_dim)
        self.last_work = (plan.tokens, plan.sum_sq)
        # host-side lengths (seqlens is a CPU tensor): the varlen pass's real rows, else B full rows
        self.last_flops = self.pass_flops([int(n) for n in seqlens.tolist()] if plan.kind == "varlen" and seqlens is not None
                                          else [length] * batch)
        layers = self.layers
        if plan.kind == "varlen":
            assert plan.layout is not None
            hidden = x.reshape(-1, x.shape[-1]).index_select(0, plan.layout.indices)  # [T, H]
            positions = plan.layout.indices % length
            global_attn: LayerAttention = plan.layout
            local_attn: LayerAttention = plan.layout
        else:
            hidden = x
            positions = torch.arange(length, device=x.device).unsqueeze(0)
            global_attn = plan.bias
            if x.is_cuda and x.dtype in _HALF and cfg.head_dim % 8 == 0 and plan.kind == "dense":
                # flash with a window over full rows: the uniform layout of B rows of L tokens
                local_attn = varlen_layout([length] * batch, length, x.device)
            else:
                window = window_bias(length, cfg.window, x.dtype, x.device)[None, None]
                local_attn = window if plan.bias is None else torch.clamp_min(plan.bias + window, torch.finfo(x.dtype).min)
            if self._compiled is not None and plan.static:
                layers = self._compiled  # type: ignore[assignment]
        tables = {g: rotary_tables(positions, cfg.head_dim, cfg.global_rope_theta if g else cfg.local_rope_theta, x.dtype)
                  for g in {layer.is_global for layer in self.layers}}
        with attention_backends(plan):  # a masked shape that changes per batch: no per-shape cuDNN graphs
            for i, (module, layer) in enumerate(zip(layers, self.layers)):
                cos, sin = tables[layer.is_global]
                hidden = run_layer(module, hidden, global_attn if layer.is_global else local_attn, cos, sin,
                                   checkpointed=is_checkpointed(i, self.checkpoint_period))
        hidden = self.final_norm(hidden)
        if plan.kind == "varlen":
            assert plan.layout is not None
            out = hidden.new_zeros(batch * length, hidden.shape[-1]).index_copy(0, plan.layout.indices, hidden)
            return out.view(batch, length, -1)
        return hidden


class ModernBertEncoder(nn.Module):
    """`ModernBertModel`: embeddings + layer stack (with its final norm). Same call as `BertEncoder`."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = ModernBertEmbeddings(cfg)
        self.encoder = ModernBertLayerStack(cfg)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, seqlens: Optional[Tensor] = None) -> EncoderOutput:
        e = self.embeddings(input_ids)
        return EncoderOutput(self.encoder(e, attention_mask, seqlens), e)


class ModernBertHeadTransform(nn.Module):
    """HF's `ModernBertPredictionHead`: LayerNorm(GELU(W h)) (`dense`, `norm`)."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(F.gelu(self.dense(x)))


class ModernBertPredictions(nn.Module):
    """`cls.predictions`: the transform, then the tied projection (`decoder`: token embeddings + bias)."""

    def __init__(self, cfg: ModernBertConfig, tok_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.transform = ModernBertHeadTransform(cfg)
        self.decoder = TiedVocabProjection(tok_embeddings)

    def forward(self, hidden: Tensor, fn=None, *args, **kwargs):
        return self.decoder(self.transform(hidden), fn, *args, **kwargs)


class ModernBertMLMHead(nn.Module):
    """`cls` (holds `predictions`): the same call as `MLMHead`, `head(hidden, fn, *args)`."""

    def __init__(self, cfg: ModernBertConfig, tok_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.predictions = ModernBertPredictions(cfg, tok_embeddings)

    def forward(self, hidden: Tensor, fn=None, *args, **kwargs):
        return self.predictions(hidden, fn, *args, **kwargs)


@torch.no_grad()
def init_modernbert_weights(module: nn.Module, cfg: ModernBertConfig) -> None:
    """ModernBERT's initialisation (HF `_init_weights`): truncated normals cut at +-`initializer_cutoff_factor`
    std, std sigma = `initializer_range` for inputs (`Wqkv`, `Wi`, embeddings) and sigma / sqrt(2 L) for
    outputs (`Wo`, the head's dense; L the main model's depth); zero biases, unit norms. Other linear
    layers (objective heads) get the same truncated N(0, sigma)."""
    sigma, cut = cfg.initializer_range, cfg.initializer_cutoff_factor
    out_std = sigma / math.sqrt(2.0 * cfg.num_layers)

    def trunc(weight: Tensor, std: float) -> None:
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cut * std, b=cut * std)

    outputs = {id(m.Wo) for m in module.modules() if isinstance(m, (ModernBertAttention, ModernBertMLP))}
    outputs |= {id(m.dense) for m in module.modules() if isinstance(m, ModernBertHeadTransform)}
    for m in module.modules():
        if isinstance(m, nn.Linear):
            trunc(m.weight, out_std if id(m) in outputs else sigma)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            trunc(m.weight, sigma)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
