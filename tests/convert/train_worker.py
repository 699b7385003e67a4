"""Worker for the conversion tests (run under `torchrun`, or alone for one rank).

    python tests/convert/train_worker.py REFERENCE_FILE PRESET [dotted overrides ...]

1. trains with `pipeline.train.loop.main(["--config", PRESET, *overrides])` (the real loop: data,
   DeepSpeed engine, checkpoint with `pipeline_meta.json` and `latest`);
2. builds a fresh engine the way the loop does and restores it from the checkpoint just written
   with the pipeline's own resume path (`plan_resume` + `load_checkpoint`, i.e. DeepSpeed's
   loader for that ZeRO stage and rank count — independent of the converter's consolidation);
3. runs the restored training model's own forward in eval mode on a probe batch — encoder +
   MLM head, and for COCO-LM the generator (shared embeddings -> generator layers -> its head
   through the tied projection) — and rank 0 saves the logits, hidden states and the objective
   parameters to REFERENCE_FILE.

Every rank runs every forward: under ZeRO-3 each module gathers its parameters collectively.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def probe_batch(shards_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two real rows of the shards; the second padded after 20 tokens (padding must match too)."""
    from pipeline.data.reader import ShardDataset

    dataset = ShardDataset(shards_dir)
    ids = torch.stack([torch.tensor(dataset[i]["input_ids"].tolist(), dtype=torch.long) for i in (0, 1)])
    ids = ids[:, :40].clone()
    mask = torch.ones_like(ids)
    ids[1, 20:] = dataset.special_tokens["pad"]
    mask[1, 20:] = 0
    return ids, mask


def main(argv: list[str]) -> int:
    import deepspeed

    from pipeline.train.run_config import check_run, load_config
    from pipeline.distributed import discover
    from pipeline.pretrain.build import build_pretrain_model
    from pipeline.objectives.mlm_nce import log_proposal_samplers
    from pipeline.train.checkpoint.tags import CHECKPOINT_DIR, plan_resume, read_latest
    from pipeline.train.checkpoint.load import load_checkpoint
    from pipeline.train.engine import build_deepspeed_config
    from pipeline.train.cli import main as train_main
    from pipeline.train.optim import build_optimizer

    reference_file, preset, overrides = argv[0], argv[1], argv[2:]
    code = train_main(["--config", preset, *overrides])
    if code != 0:
        return code

    cfg = load_config(preset, overrides)
    world = discover()
    plan = check_run(cfg, world.world_size, torch.cuda.is_available())
    manifest = plan.manifest
    encoder = cfg.model.encoder_config(manifest.vocab_size, manifest.seq_len, manifest.special_tokens)
    # a different init seed: the checkpoint must overwrite every weight
    model = build_pretrain_model(encoder, cfg.objectives, manifest.special_tokens, cfg.objective_options,
                                 seed=cfg.train.seed + 1, kernels=cfg.model.kernels)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    ds_config = build_deepspeed_config(plan.engine, plan.batch, cfg.deepspeed.precision, cfg.optim.grad_clip)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    tag_dir = read_latest(Path(cfg.train.output_dir) / CHECKPOINT_DIR)
    target = plan_resume(tag_dir, cfg.to_dict(), plan.manifest_hash, world.world_size, plan.zero_stage, False)
    load_checkpoint(engine, target, world.is_main)
    engine.eval()

    ids, mask = probe_batch(cfg.data.shards_dir)
    out: dict[str, object] = {"input_ids": ids, "attention_mask": mask, "tag_dir": str(tag_dir)}
    with torch.no_grad():
        hidden = model.bert(ids, mask).last_hidden
        out["hidden"] = hidden
        out["logits"] = model.cls(hidden)
        if "cocolm" in model.objectives:
            cocolm = model.objectives["cocolm"]
            gen_hidden = cocolm.generator(model.bert.embeddings(ids), mask)
            out["generator_logits"] = cocolm.generator_head(
                gen_hidden, model.cls.predictions.decoder, lambda h, w, b: F.linear(h, w, b)
            )
        objective_params = dict(model.objectives.named_parameters())
        with deepspeed.zero.GatheredParameters(list(objective_params.values()), enabled=plan.zero_stage == 3):
            out["objective_params"] = {f"objectives.{k}": p.detach().clone() for k, p in objective_params.items()}
        bias = model.cls.predictions.decoder.bias
        with deepspeed.zero.GatheredParameters([bias], enabled=plan.zero_stage == 3):
            out["head_bias"] = bias.detach().clone()
        # NCE log q as the resume path restored it (the model above was built with zeros there)
        out["log_proposals"] = {f"{k}.log_proposal": s.log_proposal.clone() for k, s in log_proposal_samplers(model).items()}
    if world.is_main:
        torch.save(out, reference_file)
    return 0


if __name__ == "__main__":
    # As the training entry point ends (pipeline/train/__main__.py): gloo threads of ZeRO-3 groups that
    # outlive the process group abort interpreter finalisation now and then (SIGABRT, "terminate called
    # without an active exception", seen once here in a CI run of the 2-rank ZeRO-3 case).
    from pipeline.train.__main__ import exit_without_finalizing

    exit_without_finalizing(main(sys.argv[1:]))
