"""What ELECTRA and COCO-LM share: an auxiliary MLM generator on the main model's embeddings, the
replacements sampled from it, and the labels "was this token replaced".

Both papers corrupt a text the same way (ELECTRA: Clark et al. 2020, "ELECTRA: Pre-training Text
Encoders as Discriminators Rather Than Generators", Sec. 2; COCO-LM: Meng et al. 2021, Sec. 3.1):

1. select 15% of the tokens; the generator G reads X^mask (the selected ones mostly `[MASK]`) and is
   trained by MLM at the selected positions:  L_gen = mean_{selected i} -log p_G(x_i | X^mask);
2. X^corrupt = X^mask with every selected position replaced by x̂_i ~ p_G(. | X^mask), sampled
   *without* gradient through the sample (the sampling is not differentiable; ELECTRA Sec. 2: "we do
   not back-propagate the discriminator loss through the generator");
3. the label of every non-pad position is 1[x̂_i == x_i] ("original"; a sampled token equal to the
   original counts as original, ELECTRA Sec. 2), which ELECTRA's discriminator predicts as "replaced"
   and COCO-LM's copy head as "original".

The generator is a layer stack of the main model's family (`pipeline.model.arch.layer_stack`) over the
main model's embeddings module, called as `ctx.encoder.embeddings` inside the step (ZeRO-3 gathers it
there). COCO-LM's has the main model's width and fewer layers; ELECTRA's is narrower
(`generator_config`: ELECTRA's `generator_hidden_size`, with the FFN size and head count scaled alike,
head size kept), so its input goes through `embeddings_project` (E -> H_G, ELECTRA's
`embeddings_project`; E the embeddings' width, H unless `model.embedding_size` factorises them) and its
head's transform maps H_G back to E before the tied projection.

Sampling (`gumbel_max_sample`): argmax_v (z_v / T + G_v), G ~ Gumbel(0, 1) from `ctx.generator` (the
micro-batch's stream: exact on resume), over vocabulary chunks of `SAMPLE_CHUNK` columns, so the
[N, V] logits never exist at once. Which generator pass the samples come from (`SAMPLE_MODES`):

* `train`: the generator's training pass itself (dropout on), detached — ELECTRA's public code
  (`run_pretraining.py` samples from `mlm_output.logits`): one pass;
* `eval`: an extra no-grad pass in eval mode (no dropout) — COCO-LM's public code: two passes;
* `zero_dropout`: the training pass runs without dropout and is sampled from — one pass, no dropout.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from pipeline.config.checks import require_number
from pipeline.data.batch import batch_selected
from pipeline.kernels.functional import binary_auc, fp32_logits
from pipeline.model.encoder import EncoderConfig
from pipeline.model.heads import PredictionHeadTransform
from pipeline.objectives.base import StepContext, scalar_metric

#: Every way of sampling from the generator (module docstring); each objective accepts a subset.
SAMPLE_MODES = ("train", "eval", "zero_dropout")
#: Vocabulary columns per chunk of the generator's sampling pass (fixed: the draws depend on it).
SAMPLE_CHUNK = 8192


@torch.no_grad()
def sampling_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """fp32 logits [N, chunk] for sampling. bf16/fp16 inputs on CUDA: one GEMM in the training dtype
    with fp32 accumulation and fp32 output (`torch.mm(..., out_dtype=float32)`, what the fused loss
    kernels compute), not an fp32 copy of the weight chunk and an fp32 GEMM (~15x slower without
    TF32); elsewhere `fp32_logits`."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype:
        z = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return z if bias is None else z + bias.float()
    return fp32_logits(hidden, weight, bias)


def gumbel_max_sample(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], generator: torch.Generator,
                      chunk: Optional[int] = None, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """One token per row from softmax((W h + b) / T), and the rows' argmax, in vocabulary chunks.

        sample_n = argmax_v (z_nv / T + G_nv),  G = -log(-log U),  U ~ Uniform(0, 1) from `generator`

    is distributed exactly as softmax(z_n / T) (the Gumbel-max trick: Gumbel 1954; Maddison, Tarlow and
    Minka 2014, "A* Sampling", Sec. 2); the maximum over the whole
    vocabulary is the maximum of the chunk maxima, so only [N, chunk] fp32 logits (and noise)
    exist at a time. hidden [N, H], weight [V, H], bias [V]; `temperature` T > 0 (ELECTRA's
    `temperature`, 1 = the generator's own softmax). Returns (samples [N], argmax_v z_nv [N]); ties
    keep the first column, like `torch.argmax`. The logits are fp32 (`sampling_logits`).
    """
    rows, vocab = hidden.shape[0], weight.shape[0]
    chunk = chunk or SAMPLE_CHUNK
    device = hidden.device
    tiny = torch.finfo(torch.float32).tiny
    best_noisy = torch.full((rows,), float("-inf"), device=device)
    best_plain = torch.full((rows,), float("-inf"), device=device)
    sample = torch.zeros(rows, dtype=torch.long, device=device)
    top = torch.zeros(rows, dtype=torch.long, device=device)
    for start in range(0, vocab, chunk):
        stop = min(vocab, start + chunk)
        z = sampling_logits(hidden, weight[start:stop], None if bias is None else bias[start:stop])
        value, index = z.max(dim=1)
        better = value > best_plain
        best_plain, top = torch.where(better, value, best_plain), torch.where(better, index + start, top)
        u = torch.rand(z.shape, generator=generator, device=device).clamp_(min=tiny)
        scaled = z if temperature == 1.0 else z / temperature  # T = 1: bitwise the paper recipe's draws
        value, index = (scaled - torch.log(-torch.log(u))).max(dim=1)
        better = value > best_noisy
        best_noisy, sample = torch.where(better, value, best_noisy), torch.where(better, index + start, sample)
    return sample, top


def replaced_token_labels(corrupted_ids: Tensor, original_ids: Tensor) -> Tensor:
    """is_original [B * L] bool: 1[x^corrupt_i == x_i] at every position, flattened row-major. A sampled
    token equal to the original is original (ELECTRA Sec. 2, COCO-LM Sec. 3.1); ELECTRA's discriminator
    target is its negation ("replaced"), COCO-LM's copy target the label itself."""
    return corrupted_ids.reshape(-1) == original_ids.reshape(-1)


@torch.no_grad()
def rtd_metrics(original_logits: Tensor, is_original: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """A binary head read as replaced-token detection (RTD, ELECTRA's task), beside its chance levels.
    `original_logits` [T] score "original" (COCO-LM's copy logit w.h_i; ELECTRA's discriminator logit
    negated):

        rtd_auc      = AUC of -original_logits for "x^corrupt_i != x_i" over the kept (non-pad) tokens;  chance 0.5
        rtd_accuracy = share of kept tokens with 1[original_logit_i > 0] == 1[x^corrupt_i == x_i]
        rtd_accuracy_chance = share of kept tokens left original: the accuracy of answering "original" always

    A head stuck at a constant answer scores rtd_accuracy == rtd_accuracy_chance and rtd_auc 0.5
    (the time-to-quality study's COCO-LM: 0.864 of 0.864). All device tensors, no host read.
    """
    kept = keep.float()
    count = kept.sum().clamp(min=1)
    original = is_original & keep.bool()
    return {
        "rtd_auc": binary_auc(-original_logits, ~is_original, keep),
        "rtd_auc_chance": scalar_metric(0.5, original_logits.device),
        "rtd_accuracy": (((original_logits > 0) == is_original).float() * kept).sum() / count,
        "rtd_accuracy_chance": original.float().sum() / count,
    }


@contextlib.contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Temporarily put modules in eval mode (dropout off), restoring each one's previous mode."""
    previous = [m.training for m in modules]
    try:
        for m in modules:
            m.eval()
        yield
    finally:
        for m, was_training in zip(modules, previous):
            m.train(was_training)


def check_generator_options(generator_layers: Any, sample_mode: Any, sample_temperature: Any,
                            allowed_modes: tuple[str, ...] = SAMPLE_MODES) -> None:
    """The options both generator objectives (ELECTRA, COCO-LM) share, refused before any compute: a
    `sample_mode` of `allowed_modes`, a finite `sample_temperature` > 0 (inf would sample uniformly,
    the generator's logits ignored), and `generator_layers` an integer >= 1 or None (the objective's
    default depth). Each error starts with the option's name (`registry.build_objective` prefixes its
    config path)."""
    if not isinstance(sample_mode, str) or sample_mode not in allowed_modes:
        raise ValueError(f"sample_mode must be one of {allowed_modes}, got {sample_mode!r}")
    require_number(sample_temperature, "sample_temperature", above=0)
    if generator_layers is not None:
        require_number(generator_layers, "generator_layers", at_least=1, integer=True)


def generator_config(main: Any, width: float) -> Any:
    """The config of a generator `width` times as wide as the main model (ELECTRA's `generator_hidden_size`,
    Clark et al. 2020, Table 6: 1/4 small, 1/3 base): hidden H_G = round(width * H); the FFN scaled by the
    same factor (the main model's FFN / hidden ratio: ELECTRA's 4 H_G for BERT); the head size kept, so
    max(1, H_G // head size) heads (ELECTRA's H_G // 64). `width` 1 returns `main` itself (COCO-LM)."""
    require_number(width, "generator_width", above=0, at_most=1, hint=" (a fraction of the hidden size)")
    if width == 1.0:
        return main
    hidden = int(round(main.hidden_size * width))
    head_size = main.hidden_size // main.num_heads
    heads = max(1, hidden // head_size)
    if hidden < 2 or hidden % heads:
        raise ValueError(f"generator_width={width} gives a generator hidden size of {hidden} "
                         f"(of {main.hidden_size}), which {heads} heads of the main model's head size {head_size} "
                         "do not divide; choose a width whose hidden size is a multiple of the head size or below it")
    ffn = max(1, int(round(main.ffn_size * hidden / main.hidden_size)))
    try:
        return replace(main, hidden_size=hidden, num_heads=heads, ffn_size=ffn)
    except ValueError as err:  # the family's own shape rules (ModernBERT: an even head size)
        raise ValueError(f"generator_width={width}: {err}") from None


class GeneratorHead(nn.Module):
    """The generator's MLM head: its own transform and output bias, the tied word embeddings.

    The transform is dense(H_G -> E) -> GELU -> LayerNorm(E) (ELECTRA's `generator_predictions`; BERT's
    `cls.predictions.transform` when H_G = E = H; E the tied embeddings' width). The projection is delegated
    to the main model's `TiedVocabProjection` (which owns the tied weight, ZeRO-3 safe) with a function that swaps in this
    head's bias.
    """

    def __init__(self, cfg: EncoderConfig, in_size: Optional[int] = None) -> None:
        super().__init__()
        self.transform = PredictionHeadTransform(cfg, in_size)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, hidden: Tensor, projection: nn.Module, fn, *args):
        own_bias = self.bias

        def with_own_bias(h, weight, _main_bias, *rest):
            return fn(h, weight, own_bias, *rest)

        return projection(self.transform(hidden), with_own_bias, *args)


@dataclass
class Corruption:
    """One generator step: its MLM loss, X^corrupt, where it differs, and its metrics."""

    gen_loss: Tensor  # mean_{selected} -log p_G(x_i | X^mask), with gradient into G and the embeddings
    corrupted_ids: Tensor  # [B, L]: X^mask with every selected position replaced by a sample
    flat: Tensor  # [N] flat indices of the selected positions
    targets: Tensor  # [N] the original tokens there
    metrics: dict[str, Tensor]  # gen_loss, gen_accuracy (argmax), replaced_fraction (samples != original)


def corrupt(ctx: StepContext, stack: nn.Module, head: GeneratorHead, ids_key: str, labels_key: str,
            sample_mode: str, temperature: float = 1.0, chunk: Optional[int] = None,
            project: Optional[nn.Module] = None) -> Corruption:
    """Run the generator (`stack` over `project`(the main model's embeddings of `batch[ids_key]`)), its MLM
    loss at the positions `batch[labels_key]` selects, and X^corrupt sampled per `sample_mode` (module
    docstring) at `temperature`, in vocabulary chunks of `chunk` columns (default `SAMPLE_CHUNK`)."""
    if sample_mode not in SAMPLE_MODES:
        raise ValueError(f"sample_mode must be one of {SAMPLE_MODES}, got {sample_mode!r}")
    masked_ids = ctx.batch[ids_key]
    targets, flat = batch_selected(ctx.batch, labels_key)
    decoder = ctx.head.predictions.decoder
    embeddings = ctx.encoder.embeddings

    def states() -> Tensor:
        """Generator hidden states [N, H_G] at the selected positions (flat indices); the embeddings module's
        output is E wide (before the main model's own `embeddings_project`), `project` maps it to H_G."""
        e = embeddings(masked_ids)
        if project is not None:
            e = project(e)
        h = stack(e, ctx.batch["attention_mask"], ctx.seqlens())
        return h.reshape(-1, h.shape[-1])[flat]

    if sample_mode == "zero_dropout":
        with eval_mode(stack, embeddings):
            h_sel = states()
        h_sample = h_sel.detach()
    elif sample_mode == "train":
        h_sel = states()
        h_sample = h_sel.detach()
    else:
        h_sel = states()
        with torch.no_grad(), eval_mode(stack, embeddings):
            h_sample = states()
    gen_loss = head(h_sel, decoder, ctx.op("linear_cross_entropy"), targets)
    with torch.no_grad():
        sample = functools.partial(gumbel_max_sample, chunk=chunk, temperature=temperature)
        sampled, top = head(h_sample, decoder, sample, ctx.generator)
    corrupted = masked_ids.clone().reshape(-1)
    corrupted[flat] = sampled
    count = max(int(flat.numel()), 1)  # a shape: known on the host
    metrics = {
        "gen_loss": gen_loss.detach(),
        "gen_accuracy": (top == targets).float().sum() / count,
        "replaced_fraction": (sampled != targets).float().sum() / count,
    }
    return Corruption(gen_loss, corrupted.view_as(masked_ids), flat, targets, metrics)
