"""Config system: presets reproduce the papers' recipes, and every bad config fails before compute
with an error that names the field, flag or file."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from ds_configs import ENGINE_DIR
from pipeline.config.checks import ConfigError
from pipeline.config.loader import available_presets
from pipeline.train.run_config import RunConfig, check_run, config_differences, config_hash, load_config
from pipeline.data.config import plan_batches
from pipeline.train.engine import RUN_OWNED_ENGINE_KEYS, build_deepspeed_config
from pipeline.train.optim import lr_at


def _deepspeed_config(cfg: RunConfig, world_size: int, load_universal: bool = False) -> dict:
    plan = check_run(cfg, world_size, False)
    return build_deepspeed_config(plan.engine, plan.batch, cfg.deepspeed.precision, cfg.optim.grad_clip, load_universal)

PAPER = {  # OBJECTIVES.md: size, objectives, batch, lr, betas, eps, warm-up, steps, sequence length
    "taco-small": ("taco-small", {"mlm", "taco"}, 1280, 1e-4, (0.9, 0.999), 1e-8, 2500, 250_000, 256),
    "taco-base": ("base", {"mlm", "taco"}, 1280, 1e-4, (0.9, 0.999), 1e-8, 10_000, 500_000, 256),
    "capt-small": ("capt-small", {"mlm", "capt"}, 2048, 5e-4, (0.9, 0.98), 1e-6, 10_000, 200_000, None),
    "capt-large": ("large", {"mlm", "capt"}, 8192, 6e-4, (0.9, 0.98), 1e-6, 30_000, 500_000, None),
    "cocolm-base": ("base", {"cocolm"}, 2048, 5e-4, (0.9, 0.98), 1e-6, 10_000, 125_000, 512),
    "cocolm-large": ("large", {"cocolm"}, 2048, 2e-4, (0.9, 0.98), 1e-6, 10_000, 125_000, 512),
    "infoword-base": ("base", {"infoword"}, 1024, 4e-4, (0.9, 0.98), 1e-6, 18_000, 400_000, 512),
    "infoword-large": ("large", {"infoword"}, 1024, 1e-4, (0.9, 0.98), 1e-6, 18_000, 400_000, 512),
    "electra-small": ("electra-small", {"electra"}, 128, 5e-4, (0.9, 0.999), 1e-6, 10_000, 1_000_000, 128),
    "electra-base": ("base", {"electra"}, 256, 2e-4, (0.9, 0.999), 1e-6, 10_000, 766_000, 512),
    "electra-large": ("large", {"electra"}, 2048, 2e-4, (0.9, 0.999), 1e-6, 10_000, 400_000, 512),
}


@pytest.mark.parametrize("preset", sorted(PAPER))
def test_paper_presets_and_their_mlm_baselines(preset):
    size, objectives, batch, lr, betas, eps, warmup, steps, seq_len = PAPER[preset]
    cfg = load_config(preset)
    assert (cfg.model.size, set(cfg.objectives), cfg.data.global_batch_size) == (size, objectives, batch)
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.eps, cfg.optim.warmup_steps) == (lr, betas, eps, warmup)
    assert (cfg.optim.weight_decay, cfg.train.total_steps, cfg.data.seq_len) == (0.01, steps, seq_len)
    baseline = load_config(f"mlm-{preset}")
    assert baseline.objectives == {"mlm": 1.0} and baseline.objective_options == {}
    same = {**baseline.to_dict(), "name": cfg.name, "objectives": cfg.objectives,
            "objective_options": cfg.objective_options}
    assert same == cfg.to_dict()  # the baseline differs in nothing but the objectives


def test_paper_specific_options():
    assert load_config("taco-small").objective_options["taco"] == {"window": 5, "num_negatives": 50, "tau": 0.07}
    capt = load_config("capt-large").objective_options["capt"]
    assert capt["queue_size"] == 8192 and capt["tau"] is None  # adaptive temperature
    assert load_config("taco-small").deepspeed.precision == "fp16"
    assert load_config("cocolm-base").objective_options["cocolm"]["lambda_copy"] == 50.0
    for preset, width, rate in (("electra-small", 0.25, 0.15), ("electra-base", 0.33333, 0.15),
                                ("electra-large", 0.25, 0.25)):  # ELECTRA Table 6: generator size, mask percent
        cfg = load_config(preset)
        electra = cfg.objective_options["electra"]
        assert (electra["generator_width"], electra["lambda_disc"], electra["sample_temperature"]) == (width, 50.0, 1.0)
        assert cfg.data.corruption == {"mask_rate": rate, "mask_fraction": 0.85, "random_fraction": 0.0}


def test_every_preset_loads():
    presets = available_presets()
    assert {f"tiny-{o}" for o in ("mlm", "taco", "capt", "cocolm", "infoword", "mlm-nce")} <= set(presets)
    for name in presets:
        assert load_config(name).name == name


def test_overrides_parse_yaml_values_and_set_keys_inside_mappings():
    cfg = load_config("tiny-taco", ["optim.betas=[0.8,0.9]", "objective_options.taco.tau=0.1", "train.seed=7",
                                    "objectives={mlm: 1.0}", "objective_options={}"])
    assert cfg.optim.betas == (0.8, 0.9) and cfg.train.seed == 7 and cfg.objectives == {"mlm": 1.0}
    cfg = load_config("tiny-taco", ["objective_options.taco.tau=0.1"])
    assert cfg.objective_options["taco"] == {"num_negatives": 8, "tau": 0.1}


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.total_step=5", "did you mean 'total_steps'"),
        ("optimm.lr=1", "did you mean 'optim'"),
        ("train.total_steps=abc", "train.total_steps: expected int"),
        ("optim.lr=fast", "optim.lr: expected float"),
        ("deepspeed.precision=fp8", "deepspeed.precision='fp8': must be one of"),
        ("model.kernels=cuda", "model.kernels='cuda'"),
        ("model.size=huge", "model.size='huge'"),
        ("objectives.tacoo=1", "did you mean 'taco'"),
        ("objective_options.taco.temperature=0.1", "objective_options.taco.temperature: unknown option"),
        ("objective_options.capt.queue_size=8", "'capt' is not in objectives"),
        ("data.corruption.mask_prob=0.2", "data.corruption.mask_prob: unknown option"),
        ("optim.warmup_steps=50", "must be < train.total_steps"),
        ("train.total_steps", "expected dotted.key=value"),
    ],
)
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config("tiny-taco", [override])


def test_unknown_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("inherit: tiny-mlm\noptim:\n  warmup_step: 5\n")
    with pytest.raises(ConfigError, match=r"optim\.'warmup_step' \(did you mean 'warmup_steps'\?\)"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="unknown preset.*did you mean 'tiny-mlm'"):
        load_config("tiny-mlmm")


def test_batch_arithmetic():
    cfg = load_config("tiny-mlm", ["data.global_batch_size=24", "data.micro_batch_size=4"])
    assert plan_batches(cfg.data, 1).grad_accum == 6
    assert plan_batches(cfg.data, 2).grad_accum == 3
    with pytest.raises(ConfigError, match=r"data.global_batch_size=24 is not divisible by data.micro_batch_size=4 x "
                                          r"world size 4 = 16"):
        plan_batches(cfg.data, 4)
    cfg = load_config("tiny-mlm", ["data.global_batch_size=24", "data.micro_batch_size=4", "data.grad_accum=2"])
    with pytest.raises(ConfigError, match=r"!= data.micro_batch_size=4 x data.grad_accum=2 x world size 1 = 8"):
        plan_batches(cfg.data, 1)
    assert plan_batches(cfg.data, 3).global_batch_size == 24


def test_missing_or_incomplete_shards(tiny_shards_dir, tmp_path):
    base = ["data.global_batch_size=8"]
    with pytest.raises(ConfigError, match="data.shards_dir is required"):
        check_run(load_config("tiny-mlm", base), 1, False)
    with pytest.raises(ConfigError, match="no such directory"):
        check_run(load_config("tiny-mlm", [*base, f"data.shards_dir={tmp_path / 'nope'}"]), 1, False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="manifest.json: missing"):
        check_run(load_config("tiny-mlm", [*base, f"data.shards_dir={tmp_path / 'empty'}"]), 1, False)
    broken = shutil.copytree(tiny_shards_dir, tmp_path / "broken")
    (broken / "shard_00001.arrow").unlink()
    with pytest.raises(ConfigError, match=r"missing: \['shard_00001.arrow'\]"):
        check_run(load_config("tiny-mlm", [*base, f"data.shards_dir={broken}"]), 1, False)
    with pytest.raises(ConfigError, match="data.seq_len=128 but the shards"):
        check_run(load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", "data.seq_len=128"]), 1, False)


def test_engine_files_hold_engine_settings_only():
    stages = {}
    for path in sorted(ENGINE_DIR.glob("*.json")):
        engine = json.loads(path.read_text())
        assert not set(RUN_OWNED_ENGINE_KEYS) & set(engine), path
        stages[path.stem] = engine["zero_optimization"]["stage"]
    assert stages == {"zero1": 1, "zero2": 2, "zero3": 3, "zero3-offload": 3}


def test_bad_engine_settings(tiny_shards_dir, tmp_path, monkeypatch):
    from pipeline.objectives.registry import OBJECTIVES

    def run(*extra):
        return check_run(load_config("tiny-taco", [f"data.shards_dir={tiny_shards_dir}", *extra]), 1, False)

    bad_stage = tmp_path / "zero5.json"
    bad_stage.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    with pytest.raises(ConfigError, match="zero_optimization.stage=5; DeepSpeed ZeRO stages are 0, 1, 2, 3"):
        run(f"deepspeed.config={bad_stage}")
    owns_lr = tmp_path / "lr.json"
    owns_lr.write_text(json.dumps({"zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam"}}))
    with pytest.raises(ConfigError, match=r"\['optimizer'\] belong to the run config"):
        run(f"deepspeed.config={owns_lr}")
    with pytest.raises(ConfigError, match="did you mean 'zero2'"):
        run("deepspeed.config=zero22")
    with pytest.raises(ConfigError, match="CPU offload needs a GPU"):
        run("deepspeed.config=zero3-offload")
    monkeypatch.setattr(OBJECTIVES["taco"], "max_zero_stage", 2, raising=False)
    with pytest.raises(ConfigError, match="uses ZeRO stage 3, but objective 'taco' supports stages up to 2"):
        run("deepspeed.config=zero3")
    assert run("deepspeed.config=zero2").zero_stage == 2


def test_switches_that_need_a_gpu(tiny_shards_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for override, message in [("model.kernels=triton", "model.kernels=triton needs Triton on a CUDA device"),
                              ("optim.impl=apex", "NVIDIA apex"), ("model.layernorm=apex", "NVIDIA apex"),
                              ("optim.name=lamb", "optim.name=lamb needs a GPU"),
                              ("deepspeed.precision=bf16", "deepspeed.precision=bf16 needs a GPU")]:
        with pytest.raises(ConfigError, match=message):
            check_run(load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", override]), 1, False)


def test_deepspeed_config_is_assembled_from_run_and_engine(tiny_shards_dir):
    cfg = load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", "data.global_batch_size=16",
                                   "optim.grad_clip=0.5", "deepspeed.config=zero2",
                                   "deepspeed.extra={zero_optimization: {reduce_bucket_size: 1000}}"])
    ds = _deepspeed_config(cfg, 2)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 4, 2)
    assert ds["gradient_clipping"] == 0.5 and ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000 and ds["zero_optimization"]["overlap_comm"] is False  # ds_configs/README.md
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert "checkpoint" not in ds and _deepspeed_config(cfg, 2, True)["checkpoint"] == {
        "load_universal": True}


def test_config_hash_ignores_run_control_only():
    a = load_config("tiny-mlm").to_dict()
    b = load_config("tiny-mlm", ["train.output_dir=/elsewhere", "train.log_every=7", "data.grad_accum=2",
                                 "train.keep_last=9", "data.shards_dir=/moved", "train.max_loss_ratio=5"]).to_dict()
    c = load_config("tiny-mlm", ["optim.lr=0.002", "train.total_steps=40"]).to_dict()
    assert config_hash(a) == config_hash(b) != config_hash(c)
    assert config_differences(a, c) == ["optim.lr: 0.001 -> 0.002", "train.total_steps: 20 -> 40"]
    # the micro-batch size changes what a step computes (per-micro-batch sampling, negatives, loss mean)
    d = load_config("tiny-mlm", ["data.micro_batch_size=2"]).to_dict()
    assert config_differences(a, d) == ["data.micro_batch_size: 4 -> 2"]


def test_learning_rate_schedule():
    optim = load_config("tiny-mlm", ["optim.lr=1.0", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1"]).optim
    values = [lr_at(s, optim, 10) for s in range(1, 11)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up, peak at the last warm-up step
    assert values[4] == 1.0 and values[-1] == pytest.approx(0.1 + 0.9 / 6)  # linear decay to the floor
    assert all(a > b for a, b in zip(values[4:], values[5:]))


def test_cli_reports_config_errors_before_compute(tiny_shards_dir, tmp_path, capsys):
    from pipeline.train.cli import main

    out = tmp_path / "run"
    code = main(["--config", "tiny-mlm", f"data.shards_dir={tiny_shards_dir}", f"train.output_dir={out}",
                 "data.global_batch_size=10"])
    assert code == 2 and "data.global_batch_size=10 is not divisible" in capsys.readouterr().err
    assert not out.exists()  # nothing was built or written
    assert main(["--config", "tiny-mlm", f"data.shards_dir={tiny_shards_dir}", f"train.output_dir={out}",
                 "--check"]) == 0
    assert "ok: tiny-mlm" in capsys.readouterr().out and not out.exists()


def test_zero_stage_set_through_deepspeed_extra_is_named_in_the_error(tiny_shards_dir, monkeypatch):
    from pipeline.objectives.registry import OBJECTIVES

    monkeypatch.setattr(OBJECTIVES["taco"], "max_zero_stage", 2, raising=False)
    cfg = load_config("tiny-taco", [f"data.shards_dir={tiny_shards_dir}", "deepspeed.config=zero1",
                                    "deepspeed.extra={zero_optimization: {stage: 3}}"])
    with pytest.raises(ConfigError, match=r"^deepspeed.extra.zero_optimization.stage=3 \(over deepspeed.config=zero1\) "
                                          "uses ZeRO stage 3, but objective 'taco' supports stages up to 2"):
        check_run(cfg, 1, False)


def test_check_for_another_world_size_and_for_gpu_nodes(tiny_shards_dir, tmp_path, capsys):
    """What slurm/submit.sh runs on a login node: the job's rank count, and GPU-only settings accepted."""
    from pipeline.train.cli import main

    base = ["--config", "tiny-mlm", f"data.shards_dir={tiny_shards_dir}", f"train.output_dir={tmp_path / 'run'}"]
    assert main([*base, "data.micro_batch_size=8", "--check"]) == 0
    assert main([*base, "data.micro_batch_size=8", "--check", "--world-size", "2"]) == 2
    assert "micro_batch_size=8 x world size 2" in capsys.readouterr().err
    assert main([*base, "deepspeed.precision=bf16", "--check"]) == 2
    assert main([*base, "deepspeed.precision=bf16", "--check", "--gpus"]) == 0
    with pytest.raises(SystemExit):
        main(["--config", "tiny-mlm", "--world-size", "2"])  # only with --check


def test_deepspeed_ops_build_in_a_directory_of_this_environment(tiny_shards_dir, tmp_path, monkeypatch):
    from pipeline.capabilities import private_extensions_dir
    from pipeline.train.cli import main

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    mine = private_extensions_dir()
    assert main(["--config", "tiny-mlm", f"data.shards_dir={tiny_shards_dir}", f"train.output_dir={tmp_path}",
                 "--check"]) == 0
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(mine) and mine.parent.name == "torch_extensions"
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert private_extensions_dir() != mine and private_extensions_dir().name.startswith("another-venv-")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    assert main(["--config", "tiny-mlm", f"data.shards_dir={tiny_shards_dir}", f"train.output_dir={tmp_path}",
                 "--check"]) == 0
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "chosen")  # an explicit choice is kept


def test_electra_small_embeds_at_128_like_the_paper():
    """ELECTRA-Small (Clark et al. 2020, Table 6) and its BERT-Small baseline: embeddings 128 wide under the hidden 256."""
    for name in ("electra-small", "mlm-electra-small"):
        encoder = load_config(name).model.encoder_config(30522, 128, {"pad": 0})
        assert (encoder.embedding_width, encoder.hidden_size) == (128, 256), name
    assert load_config("electra-base").model.embedding_size is None  # base: one width (the paper's 768)
