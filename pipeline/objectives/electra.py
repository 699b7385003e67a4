"""`electra`: ELECTRA — replaced-token detection (Clark et al. 2020, "ELECTRA: Pre-training Text Encoders
as Discriminators Rather Than Generators", Sec. 2), the baseline COCO-LM states its gains against.

1. Generator G: a transformer of the main model's family (`model.arch`), `generator_width` times as
   wide (H_G = round(width x H), FFN and head count scaled alike, the head size kept:
   `replaced_tokens.generator_config`; the paper's Table 6: 1/4 for small, 1/3 for base) and
   `generator_layers` deep (default: the main model's depth, ELECTRA's `generator_layers` 1.0), on the
   *main model's* embeddings module (token + position embeddings and their LayerNorm shared, the
   paper's Sec. 3.2 "we share the embeddings (both the token and positional embeddings)"), projected
   E -> H_G by `embeddings_project` when H_G != E (E: the embeddings' width, `model.embedding_size`, H
   unless factorised). Its MLM head (`GeneratorHead`: dense H_G -> E, GELU, LayerNorm, the tied word
   embeddings, its own output bias) is trained on the selected
   positions of X^mask:
       L_MLM = mean_{selected i} -log p_G(x_i | X^mask)
2. X^corrupt: X^mask with every selected position i replaced by x̂_i ~ p_G(. | X^mask), sampled
   without gradient through the sample (`replaced_tokens.corrupt`: Gumbel-max in vocabulary chunks
   from the micro-batch's stream, exact on resume). `sample_mode="train"` (default, the public code:
   `run_pretraining.py` samples from the generator's training logits, dropout on) samples from the
   training pass itself; `"eval"` / `"zero_dropout"` as COCO-LM's. `sample_temperature` T samples
   softmax(z / T) (the public code's `temperature`, default 1).
3. Discriminator D: the main model on X^corrupt, with ELECTRA's head `discriminator_predictions`
   (dense H -> H, GELU, dense_prediction H -> 1) on every position:
       L_Disc = mean_{non-pad i} BCE(sigmoid(D(X^corrupt)_i), 1[x̂_i != x_i])
   over every non-pad token (the `[CLS]` / `[SEP]` ones included, as the public code weights by the
   input mask); a sampled token equal to the original counts as original
   (`replaced_tokens.replaced_token_labels`). The paper writes sums over positions; its code and
   `transformers.ElectraForPreTraining` average, as here (`functional.replaced_token_detection_loss`).

   L = lambda_gen L_MLM + lambda_disc L_Disc        (lambda_gen 1, lambda_disc 50: the paper's lambda)

The discriminator's loss does not reach the generator: the samples are integers, and the generator's
only gradient is L_MLM's (through the shared embeddings both train; the paper's Sec. 3.2).

Paper defaults (Sec. 3 / Table 6 and `configure_pretraining.py`) and where they are set: 15% masked
(`data.corruption.mask_rate`), of which 85% `[MASK]` and 15% kept, no random tokens (the public code's
`mask`; `data.corruption: {mask_fraction: 0.85, random_fraction: 0.0}` in the presets), generator width
1/4 (small) or 1/3 (base), full depth, lambda 50, T = 1, sampling from the training pass. Choices the
paper leaves open are options: `view` (`masked` or `wwm_masked`), `generator_layers`, `sample_mode`,
`sample_temperature`. ELECTRA-Small's factorised embeddings (embedding size 128 below the hidden 256) are
`model.embedding_size` (`pipeline.model.encoder.BertEncoder`: the discriminator projects E -> H, the
generator E -> H_G). Not implemented: the `disallow_correct` and `untied_generator_embeddings` ablations.

The main model's MLM head (`cls.predictions`) is not trained by this objective (`mlm_head` None):
conversion exports the discriminator as `ElectraForPreTraining` (`pipeline.export.electra_adapter`).

Learning signals (logged steps): `rtd_auc` (chance 0.5) and `rtd_accuracy` (chance: the share of
original tokens) of the discriminator, `gen_accuracy` against the unigram plateau and `gen_loss`
against the unigram entropy (`pipeline.monitor.signals`); the discriminator's token states feed
`health/token_cosine` (`StepContext.encode_private`). Small-scale measurements:
docs/objectives.md#electra.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.config.checks import require_number
from pipeline.data.batch import masked_view_keys
from pipeline.model.arch import layer_stack
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import Objective, StepContext, register
from pipeline.objectives.replaced_tokens import (SAMPLE_CHUNK, GeneratorHead, check_generator_options, corrupt,
                                                 generator_config, replaced_token_labels, rtd_metrics)

#: `StepContext.encode_private` name of X^corrupt (`pipeline.monitor.health.HEALTH_INPUTS` reads it).
CORRUPTED = "corrupted_ids"


class DiscriminatorHead(nn.Module):
    """ELECTRA's `discriminator_predictions`: dense(H, H) -> GELU -> dense_prediction(H, 1), one logit per
    token ("replaced"); the names are `transformers.ElectraDiscriminatorPredictions`'."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dense_prediction = nn.Linear(cfg.hidden_size, 1)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.dense_prediction(F.gelu(self.dense(hidden))).squeeze(-1)


@register
class ReplacedTokenDetection(Objective):
    """ELECTRA (see the module docstring). Options: view, generator_width, generator_layers, sample_mode,
    sample_temperature, lambda_disc, lambda_gen."""

    name = "electra"
    views = ("masked",)
    mlm_head = None  # the generator has its own head; the main model's `cls.predictions` is not trained

    def __init__(
        self,
        encoder_config: EncoderConfig,
        special_tokens: Mapping[str, int],
        view: str = "masked",
        generator_width: float = 0.25,
        generator_layers: Optional[int] = None,
        sample_mode: str = "train",
        sample_temperature: float = 1.0,
        lambda_disc: float = 50.0,
        lambda_gen: float = 1.0,
    ) -> None:
        super().__init__()
        self.ids_key, self.labels_key = masked_view_keys(view, ("masked", "wwm_masked"))
        check_generator_options(generator_layers, sample_mode, sample_temperature)
        layers = encoder_config.num_layers if generator_layers is None else generator_layers
        for name, weight in (("lambda_disc", lambda_disc), ("lambda_gen", lambda_gen)):
            require_number(weight, name, at_least=0)
        if lambda_disc == 0 and lambda_gen == 0:  # L = 0 * L_MLM + 0 * L_Disc: no gradient reaches anything
            raise ValueError("lambda_disc and lambda_gen are both 0: electra would train nothing; give either a "
                             "positive weight, or set objectives.electra to 0 to switch the objective off")
        self.views = (view,)
        self.sample_mode = sample_mode
        self.sample_temperature = float(sample_temperature)
        self.lambda_disc, self.lambda_gen = float(lambda_disc), float(lambda_gen)
        gen = generator_config(encoder_config, generator_width)
        self.generator_config = gen  # its shape (conversion writes it as ElectraForMaskedLM's config)
        width = encoder_config.embedding_width  # E: the shared embeddings' width (H unless factorised)
        if gen.hidden_size != width:  # ELECTRA's (and `transformers.ElectraModel`'s) generator `embeddings_project`
            self.embeddings_project = nn.Linear(width, gen.hidden_size)
        else:
            self.embeddings_project = None
        self.generator = layer_stack(gen, num_layers=layers)  # the main model's family (`model.arch`)
        self.generator_head = GeneratorHead(encoder_config, in_size=gen.hidden_size)
        self.discriminator_predictions = DiscriminatorHead(encoder_config)
        self.sample_chunk = SAMPLE_CHUNK  # vocabulary columns per sampling chunk (the draws depend on it)

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        step = corrupt(ctx, self.generator, self.generator_head, self.ids_key, self.labels_key, self.sample_mode,
                       self.sample_temperature, self.sample_chunk, project=self.embeddings_project)
        attention_mask = ctx.batch["attention_mask"]
        h = ctx.encode_private(CORRUPTED, step.corrupted_ids).last_hidden  # X^corrupt: the objective's own input
        logits = self.discriminator_predictions(h.reshape(-1, h.shape[-1]))  # [B*L]; cheap even on padding
        non_pad = attention_mask.reshape(-1).bool()  # a mask, not a gather: no host sync
        is_original = replaced_token_labels(step.corrupted_ids, ctx.batch["input_ids"])
        disc_loss = ctx.op("replaced_token_detection_loss")(logits, ~is_original, non_pad)
        loss = self.lambda_gen * step.gen_loss + self.lambda_disc * disc_loss
        metrics = dict(step.metrics, disc_loss=disc_loss.detach())
        if ctx.progress.record_metrics:
            metrics.update(rtd_metrics(-logits.detach(), is_original, non_pad))  # rtd_metrics scores "original"
        return loss, metrics
