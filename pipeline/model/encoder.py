"""BERT-style encoder with Hugging Face BERT parameter names (the heads are in `pipeline.model.heads`).

Parameter names follow `transformers.BertForMaskedLM` exactly (`bert.embeddings.*`,
`bert.encoder.layer.N.*`, `cls.predictions.*`) so conversion is a key copy, not a rewrite.
Attention uses `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient
kernels on GPU). The encoder returns both the last hidden state and the embedding-layer output,
because TACO's global bias `g = h - e` needs the latter and keeping it costs nothing extra (it is
saved for backward anyway).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


#: Size presets (layers / hidden / heads / FFN). Paper recipes: TACO Table 5, CAPT Table 4, BERT.
SIZE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=2, ffn_size=128),
    "taco-small": dict(num_layers=4, hidden_size=512, num_heads=8, ffn_size=2048),
    "capt-small": dict(num_layers=6, hidden_size=256, num_heads=4, ffn_size=1024),
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
    embedding_output: Tensor  # [B, L, H]: e, word + position + type embeddings after LayerNorm


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None) -> Tensor:
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor, attn_bias: Optional[Tensor]) -> Tensor:
        b, l, h = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, l, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        p = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=p)
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

    def forward(self, x: Tensor, attn_bias: Optional[Tensor]) -> Tensor:
        return self.output(self.self(x, attn_bias), x)


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

    def forward(self, x: Tensor, attn_bias: Optional[Tensor]) -> Tensor:
        a = self.attention(x, attn_bias)
        return self.output(self.intermediate(a), a)


class BertLayerStack(nn.Module):
    """`encoder.layer.N`: a stack of transformer layers (shared by the main model and COCO-LM's generator)."""

    def __init__(self, cfg: EncoderConfig, num_layers: Optional[int] = None) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(num_layers or cfg.num_layers))

    def forward(self, x: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
        bias = attention_bias(attention_mask, x.dtype)
        for layer in self.layer:
            x = layer(x, bias)
        return x


def attention_bias(attention_mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """[B, L] 1/0 mask -> additive [B, 1, 1, L] bias for SDPA (None when nothing is padded)."""
    if attention_mask is None:
        return None
    keep = attention_mask[:, None, None, :].to(torch.bool)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


class BertEncoder(nn.Module):
    """`BertModel` without pooler: embeddings + layer stack. Keys match HF `bert.*`."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertLayerStack(cfg)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        token_type_ids: Optional[Tensor] = None,
    ) -> EncoderOutput:
        e = self.embeddings(input_ids, token_type_ids)
        return EncoderOutput(self.encoder(e, attention_mask), e)


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
