"""`python -m pipeline.export.convert CHECKPOINT_DIR OUT_DIR`: a DeepSpeed checkpoint -> a Hugging Face BERT dir.

CHECKPOINT_DIR is a checkpoint tag directory (it holds `pipeline_meta.json`), a checkpoints
directory with a `latest` pointer, or a run's output directory (`<run>/checkpoints/latest`).

Steps, each failing with a message that names the file at fault and leaving OUT_DIR untouched:
1. check the tag is complete and intact (`pipeline.train.checkpoint.tags.verify_checkpoint`: every file
   at the size and sha256 recorded in `COMPLETE.json` when it was saved), read `pipeline_meta.json`
   (encoder shape, objectives, special tokens, tokenizer dir) and the tokenizer before any heavy work.
   The tokenizer must be the one the run trained with: its files' fingerprint is compared with the
   one training recorded (`tokenizer_hash` of the meta, the shards' `tokenizer_hash`), so shards
   rebuilt in place with another tokenizer are refused naming both fingerprints; a `--tokenizer DIR`
   with other files is compared with the run's own tokenizer (`tokenizer_dir` of the meta, while it
   still has the recorded fingerprint) as training compares `model.init_from`'s
   (`warm_start.tokenizer_difference`); a directory without tokenizer files is refused
   (`pipeline.tokenizer_checks`);
2. consolidate the fp32 master weights of every rank with DeepSpeed's own
   `zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` (ZeRO 1/2/3, any number of ranks,
   CPU only). A checkpoint without ZeRO partitions (stage 0) is read from its single model file;
   with `--weights DIR`, the weights `zero_to_fp32.py` already wrote are read instead (.bin,
   sharded, safetensors: `pipeline.export.consolidated`), and must be the tag's own: equal to the
   module state DeepSpeed saved in the tag (ZeRO 0-2; ZeRO-3: to its consolidated partitions) once
   cast to its precision (`consolidated.weights_difference`), else refused by name (exit 2), so a
   card never names one step while the weights are another's;
3. check the weights against the model the meta describes, sort them into the HF main model,
   the COCO-LM generator and `objective_heads.safetensors` (`pipeline.export.hf_adapter`; an ELECTRA
   run: the discriminator as `ElectraForPreTraining`, its generator as `ElectraForMaskedLM`,
   `pipeline.export.electra_adapter`); an MLM
   head trained only with sampled negatives (`mlm-nce`, `infoword`) gets its bias corrected by the
   checkpoint's log q (`hf_adapter.head_bias_correction`), stated in the card and in the export's
   `pipeline_meta.json` (`conversion.mlm_head_bias`);
4. the health check (`pipeline.export.health_check`): a loud warning on stderr, and in the card,
   when the encoder looks collapsed; measured only on the shards the run trained on (their manifest's
   identity equals the one recorded at training, else a note in the card says why it was not);
5. write config, safetensors, tokenizer (config cleaned of load-time keys), objective heads with
   their rebuild recipe (`pipeline.export.objective_heads`), `pipeline_meta.json` and the model card
   (`pipeline.export.model_card`), the sentence-transformers configuration with the pooling of the
   run's own sequence representation or `--pooling` (`pipeline.export.sentence_embedding`; a pooling
   the tokenizer cannot honour is refused in step 1) and the tokenizer's fingerprint, which the tools
   that read the export check (`pipeline.tokenizer_checks.converted_tokenizer_problem`), into a
   temporary sibling directory (`.OUT_DIR.tmp-HOST-PID`) and rename it to OUT_DIR only when
   everything is written.
An output that cannot be written (read-only or full filesystem, quota) ends with one line naming
it and exit 4 (`EXIT_WRITE_FAILED`, as training's failed saves); a previous export in OUT_DIR is
left as it was. A SIGTERM/SIGINT removes the temporary directory before exiting; what a killed (`kill -9`)
conversion into the same OUT_DIR left behind on this host is removed (or, for a previous export
set aside at the moment of the kill, restored) by the next one (`clean_stale_siblings`).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from safetensors import SafetensorError

from pipeline.export.hf_adapter import (
    HFExport,
    bert_config,
    check_state_dict,
    contiguous_copies,
    split_for_hf,
)
from pipeline.export.consolidated import consolidated_files, fill_tied, load_consolidated, weights_difference
from pipeline.export.convert_report import CONVERSION_KEY, GENERATOR_SUBDIR, render, summary
from pipeline.export.health_check import HealthReport, announce, check_health
from pipeline.export.model_card import CardInputs, public, render_model_card
from pipeline.export.objective_heads import OBJECTIVE_HEADS_FILE, write_objective_heads
from pipeline.export.sentence_embedding import META_KEY as SENTENCE_KEY, POOLINGS, TRANSFORMER_DIR, SentencePooling, \
    chosen_pooling, pooling_problem, write_sentence_config
from pipeline.export.modernbert_adapter import modernbert_hf_config, split_modernbert_for_hf
from pipeline.export.electra_adapter import (export_refusal, is_electra_run, masked_lm_as_electra,
                                             split_electra_for_hf)
from pipeline.export.generator_record import GENERATOR_FINGERPRINT_KEY, generator_fingerprint
from pipeline.export.export_tokenizer import clean_tokenizer_config, load_tokenizer
from pipeline.model.arch import AnyEncoderConfig, encoder_config_from_dict
from pipeline.pretrain.build import model_from_meta
from pipeline.model.encoder import fuse_qkv
from pipeline.model.hf_names import ExportError
from pipeline.model.modernbert import is_modernbert
from pipeline.tokenizer_checks import FINGERPRINT_KEY, tokenizer_fingerprint
from pipeline.train.checkpoint.tags import CHECKPOINT_DIR, COMPLETE_FILE, CheckpointError, read_latest, verify_checkpoint
from pipeline.train.run_meta import META_FILE, RunMeta
from pipeline.safe_load import UnsafeCheckpointError, load_pt, safe_unpickling

#: Exit code when OUT_DIR cannot be written (training's `EXIT_SAVE_FAILED`); 2 for every other refusal.
EXIT_WRITE_FAILED = 4


class ExportWriteError(OSError):
    """OUT_DIR cannot be written (read-only, full, quota); the message says what survived."""


def resolve_tag_dir(path: str | os.PathLike) -> Path:
    """The complete checkpoint tag directory that `path` designates (follows `latest` pointers).

    Completeness is `pipeline.train.checkpoint.tags.verify_checkpoint`'s with hashes: `COMPLETE.json`
    present and every file every rank wrote at its recorded size and sha256, so a partial,
    truncated or garbled (even at the same size) save is refused here, before any weights are read.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    looks_like_tag = (
        (path / META_FILE).is_file() or (path / COMPLETE_FILE).is_file() or any(path.glob("*_model_states.pt"))
    )
    tag_dir: Optional[Path] = path if looks_like_tag else None
    for root in () if looks_like_tag else (path, path / CHECKPOINT_DIR):
        tag_dir = read_latest(root)
        if tag_dir is not None:
            break
    if tag_dir is None and consolidated_files(path):
        raise CheckpointError(
            f"{path}: weights written by DeepSpeed's zero_to_fp32.py, without the run's pipeline_meta.json; pass "
            f"the checkpoint they came from and these weights: cpt-convert RUN_OR_STEP_DIR OUT_DIR --weights {path}")
    if tag_dir is None:
        raise CheckpointError(
            f"{path}: neither a checkpoint tag directory (no {META_FILE}) nor a directory with a 'latest' pointer"
        )
    verify_checkpoint(tag_dir, check_hashes=True)
    return tag_dir


def _zero_partitioned(tag_dir: Path) -> bool:
    return bool(glob.glob(str(tag_dir / "*zero_pp_rank_*_optim_states.pt")))


def consolidate_fp32_weights(tag_dir: Path) -> tuple[dict[str, torch.Tensor], str]:
    """(full fp32 state dict, description of where it came from) for one checkpoint tag dir."""
    if _zero_partitioned(tag_dir) and not glob.glob(str(tag_dir / "bf16_zero_pp_rank_*")):
        try:
            # DeepSpeed logs (from its import on) and reports progress on stdout; keep our stdout
            # for our own one-line summary.
            with contextlib.redirect_stdout(sys.stderr), safe_unpickling():  # every file it opens: restricted
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        except UnsafeCheckpointError as err:
            raise CheckpointError(str(err)) from None
        except Exception as err:  # torch.load / DeepSpeed raise many types for a broken file
            raise CheckpointError(
                f"{tag_dir}: cannot consolidate the ZeRO checkpoint: {type(err).__name__}: {err}"
            ) from err
        return state, "fp32 master weights consolidated from the ZeRO partitions"
    # No ZeRO fp32 partitions (stage 0, or DeepSpeed's bf16 optimizer): the model file holds the
    # full module. It is fp32 when training ran in fp32; half-precision copies are upcast, noted.
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    if not model_file.is_file():
        raise CheckpointError(
            f"{tag_dir}: no ZeRO optimizer partitions and no {model_file.name}; not a DeepSpeed checkpoint"
        )
    try:
        module = load_pt(model_file)["module"]
    except UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from None
    except Exception as err:
        raise CheckpointError(f"{model_file}: unreadable: {type(err).__name__}: {err}") from err
    half = sorted({str(v.dtype) for v in module.values() if v.is_floating_point() and v.dtype != torch.float32})
    source = "module weights of the (non-ZeRO) model file"
    if half:
        warnings.warn(f"{model_file}: weights stored as {half}, no fp32 master copy; upcasting to fp32")
        source += f", upcast from {', '.join(half)}"
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}, source


def tag_weights(tag_dir: Path) -> dict[str, torch.Tensor]:
    """What the tag itself says its weights are: DeepSpeed's module state in the model file (ZeRO 0-2:
    the whole module in the training precision), or, where that holds ZeRO-3's empty placeholders,
    the fp32 weights consolidated from the tag's partitions."""
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    if model_file.is_file():
        try:
            module = load_pt(model_file, mmap=True).get("module") or {}
        except Exception as err:  # torch.load raises many types for a broken file
            raise CheckpointError(f"{model_file}: unreadable: {type(err).__name__}: {err}") from err
        tensors = {k: v for k, v in module.items() if isinstance(v, torch.Tensor)}
        if tensors and all(v.numel() > 0 for v in tensors.values()):
            return tensors
    return consolidate_fp32_weights(tag_dir)[0]


def check_weights_of_tag(tag_dir: Path, weights: Path, state: dict[str, torch.Tensor]) -> None:
    """`--weights` must hold `tag_dir`'s own weights (`consolidated.weights_difference`)."""
    difference = weights_difference(tag_weights(tag_dir), state)
    if difference:
        raise ExportError(
            f"--weights {weights}: not the weights of {tag_dir.name} ({difference}); pass zero_to_fp32.py's output "
            f"for this tag (python {tag_dir.parent / 'zero_to_fp32.py'} {tag_dir.parent} OUT --tag {tag_dir.name}), "
            "or convert without --weights")


def _write_hf_model(
    directory: Path, state: dict[str, torch.Tensor], encoder: AnyEncoderConfig, meta: RunMeta, tokenizer,
    config=None,
) -> None:
    """`config`: the `transformers` config to write (an objective's own class, e.g. ELECTRA's); None: the
    family's masked-LM config of `encoder` (`model.arch`)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = (modernbert_hf_config if is_modernbert(encoder) else bert_config)(encoder, meta.special_tokens)
    config.save_pretrained(str(directory))
    save_file(contiguous_copies(state), str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(directory))
    clean_tokenizer_config(directory)


def write_export(directory: Path, export: HFExport, meta: RunMeta, tokenizer, tag_dir: Path, model,
                 with_generator: bool, card: CardInputs, sentence: Optional[SentencePooling] = None) -> None:
    """Everything OUT_DIR holds, written into `directory` (`model`: the training model of the meta;
    `sentence`: the sentence-transformers pooling, default the run's own)."""
    encoder = encoder_config_from_dict(meta.encoder_config)
    _write_hf_model(directory, export.main, encoder, meta, tokenizer, export.hf_config)
    sentence = sentence or sentence_pooling(meta, encoder, tokenizer, None, None)
    write_sentence_config(directory, sentence, encoder.hidden_size, tokenizer)
    clean_tokenizer_config(directory / TRANSFORMER_DIR)
    if export.objective_heads:
        write_objective_heads(directory / OBJECTIVE_HEADS_FILE, model, export.objective_heads, meta)
    if with_generator:
        gen = export.generator
        assert gen is not None
        _write_hf_model(directory / GENERATOR_SUBDIR, gen.state, gen.config, meta, tokenizer, gen.hf_config)
        (directory / GENERATOR_SUBDIR / "README.md").write_text(render_model_card(meta, export, card, True))
    # The run's full record, with local paths reduced to their last component (exports are shared:
    # they must not reveal where the data or the run lived), and what the conversion changed.
    record = public(json.loads((tag_dir / META_FILE).read_text()))
    conversion = record.setdefault(CONVERSION_KEY, {})
    if export.head_bias is not None:
        conversion["mlm_head_bias"] = export.head_bias.record()
    conversion[FINGERPRINT_KEY] = tokenizer_fingerprint(directory)
    if with_generator:  # read back by `generator_record.generator_problem` before the generator is used
        conversion[GENERATOR_FINGERPRINT_KEY] = generator_fingerprint(directory / GENERATOR_SUBDIR)
    conversion[SENTENCE_KEY] = sentence.record()
    (directory / META_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    (directory / "README.md").write_text(render_model_card(meta, export, card, False))
    _make_readable(directory)


def sentence_pooling(meta: RunMeta, encoder: AnyEncoderConfig, tokenizer, mode: Optional[str],
                     normalize: Optional[bool]) -> SentencePooling:
    """The export's sentence pooling (`--pooling` / `--normalize`, else the run's own), checked against
    the tokenizer; `max_seq_length` is the model's position table."""
    chosen = chosen_pooling(meta.objectives, meta.objective_options, mode, normalize)
    problem = pooling_problem(chosen, tokenizer)
    if problem:
        raise ExportError(problem)
    return SentencePooling(chosen.mode, chosen.normalize, chosen.source, int(encoder.max_position))


def _make_readable(directory: Path) -> None:
    """Plain umask permissions for every file (safetensors writes its files owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir}: not empty; pass --overwrite to replace it")


def _sibling(out_dir: Path, kind: str) -> Path:
    """`.OUT.tmp-HOST-PID` (being written) or `.OUT.old-HOST-PID` (the export being replaced)."""
    return out_dir.with_name(f".{out_dir.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale_siblings(out_dir: Path) -> list[Path]:
    """Remove the temporary directories that killed conversions into `out_dir` left on this host
    (their process is gone); a set-aside previous export is moved back when `out_dir` is missing.
    Directories of live conversions, or of other hosts (their processes cannot be checked), stay."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(tmp|old)-(?:(.+)-)?(\d+)")
    removed = []
    for path in sorted(out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*-*")):
        match = pattern.fullmatch(path.name)
        if match is None or not path.is_dir():
            continue
        kind, host, pid = match.group(1), match.group(2), int(match.group(3))
        if (host is not None and host != socket.gethostname()) or pid == os.getpid() or _pid_alive(pid):
            continue
        if kind == "old" and not out_dir.exists():
            os.replace(path, out_dir)  # killed between its two renames: the previous export comes back
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temp dir to `out_dir` (replacing an old one only after it is complete).
    SIGTERM/SIGINT wait until both renames are done, so OUT_DIR is never left missing."""
    old: Optional[Path] = None
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        if out_dir.exists():
            if any(out_dir.iterdir()):
                old = _sibling(out_dir, "old")
                os.replace(out_dir, old)
            else:
                out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _pruned_while_reading(tag_dir: Path) -> Iterator[None]:
    """A read of `tag_dir` that fails because the tag disappeared meanwhile (a training run still
    writing to the directory pruned it: `train.keep_last`) says so, instead of blaming the files
    ("not a DeepSpeed checkpoint"); any other failure is raised as it is."""
    try:
        yield
    except Exception as err:
        if tag_dir.is_dir() and (tag_dir / COMPLETE_FILE).is_file():
            raise
        latest = read_latest(tag_dir.parent) if (tag_dir.parent / "latest").is_file() else None
        raise CheckpointError(
            f"{tag_dir}: removed while it was being converted (the training run writing to {tag_dir.parent} pruned "
            f"it, train.keep_last); convert {latest or 'a newer checkpoint'} instead, or convert once the run has "
            "ended") from err


def convert(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    with_generator: bool = False,
    tokenizer_dir: Optional[str | os.PathLike] = None,
    shards_dir: Optional[str | os.PathLike] = None,
    license_id: Optional[str] = None,
    base_model: Optional[str] = None,
    weights: Optional[str | os.PathLike] = None,
    pooling: Optional[str] = None,
    normalize: Optional[bool] = None,
) -> Path:
    """Convert one checkpoint; returns OUT_DIR. Nothing is written to OUT_DIR on any error.

    shards_dir: the run's shards for the health check (default: `data_dir` of the meta);
    license_id / base_model: the card's `license` and `base_model` metadata (defaults: the base
    model's license and directory name for a warm-started run, else `unknown` / none); weights: the
    output of DeepSpeed's `zero_to_fp32.py` for this tag, read instead of the ZeRO partitions;
    pooling / normalize: the sentence-transformers pooling instead of the run's own (`sentence_embedding`)."""
    out_dir = Path(out_dir)
    clean_stale_siblings(out_dir)  # first: a previous export a killed conversion had set aside comes back
    _check_out_dir(out_dir, overwrite)
    tag_dir = resolve_tag_dir(checkpoint_dir)
    with _pruned_while_reading(tag_dir):
        meta = RunMeta.read(tag_dir)
        encoder = encoder_config_from_dict(meta.encoder_config)
        refusal = export_refusal(meta.objectives, "modernbert" if is_modernbert(encoder) else "bert", with_generator)
        if refusal:  # known from the run's config: said before its weights are consolidated
            raise ExportError(refusal)
        tokenizer = load_tokenizer(meta, tokenizer_dir, encoder)
        sentence = sentence_pooling(meta, encoder, tokenizer, pooling, normalize)
        model = model_from_meta(meta)

        if weights is not None:
            state, source = load_consolidated(Path(weights))
            state = fill_tied(model, state)
            check_weights_of_tag(tag_dir, Path(weights), state)
        else:
            state, source = consolidate_fp32_weights(tag_dir)
        state = fuse_qkv(state)  # checkpoints written before Q, K and V were fused hold them separately
        check_state_dict(model, state, str(tag_dir))
    if is_electra_run(meta.objectives):  # the discriminator as ElectraForPreTraining (`electra_adapter`)
        export = split_electra_for_hf(model, state)
    else:
        export = (split_modernbert_for_hf if is_modernbert(encoder) else split_for_hf)(model, state)
        if encoder.factorised:  # E != H: BertForMaskedLM cannot hold it
            export = masked_lm_as_electra(export, encoder, meta.special_tokens)
    if with_generator and export.generator is None:
        raise ExportError(f"--with-generator: {export.generator_note}" if export.generator_note else
                          f"--with-generator: no objective of {sorted(meta.objectives)} has a generator")
    if export.head_bias is not None and not export.head_bias.corrected:
        print(f"note: {export.head_bias.note}", file=sys.stderr)
    health: HealthReport = check_health(model, state, meta, shards_dir)
    announce(health)
    card = CardInputs(tag_dir.name, source, health, license_id, base_model)

    tmp = _sibling(out_dir, "tmp")
    previous = out_dir.is_dir() and any(out_dir.iterdir())
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        write_export(tmp, export, meta, tokenizer, tag_dir, model, with_generator, card, sentence)
        _check_out_dir(out_dir, overwrite)  # someone may have written there meanwhile
        _publish(tmp, out_dir)
    except (OSError, SafetensorError) as err:
        if isinstance(err, FileExistsError):
            raise
        raise ExportWriteError(f"{out_dir}: cannot write the export ({_write_failure(err)}); "
                               f"{'the previous export there is unchanged' if previous else 'nothing was written'}") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_failure(err: BaseException) -> str:
    """`reason: path` of a failed write, from an OSError or safetensors' error text (it wraps Rust's io::Error)."""
    if isinstance(err, OSError):
        reason = os.strerror(err.errno).lower() if err.errno else str(err)
        return f"{reason}: {err.filename}" if err.filename else reason
    code = re.search(r"code: (\d+)", str(err))
    return os.strerror(int(code.group(1))).lower() if code else str(err).splitlines()[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.export.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="checkpoint tag dir, a checkpoints dir with 'latest', or a run output dir")
    p.add_argument("out_dir", help="Hugging Face model directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.add_argument(
        "--with-generator",
        action="store_true",
        help=f"also write the generator (COCO-LM's, ELECTRA's) as a second model in OUT_DIR/{GENERATOR_SUBDIR}/",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: tokenizer_dir from pipeline_meta.json)")
    p.add_argument("--shards", default=None, help="the run's shards, for the health check (default: data_dir from "
                                                  "pipeline_meta.json)")
    p.add_argument("--license", default=None, help="license id for the card (default: the base model's, else unknown)")
    p.add_argument("--base-model", default=None, help="base_model id for the card, e.g. a Hub id (default: the "
                                                      "warm-start directory's name)")
    p.add_argument("--weights", default=None, metavar="DIR",
                   help="the output of DeepSpeed's zero_to_fp32.py for this checkpoint (pytorch_model.bin, sharded "
                        ".bin or safetensors), used instead of consolidating the ZeRO partitions")
    p.add_argument("--pooling", default=None, choices=POOLINGS,
                   help="sentence-transformers pooling (default: the sequence representation the run's objective "
                        "reads in pretraining, else mean; docs/conversion.md#sentence-transformers)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (the directory, its files, what conversion changed) instead of lines")
    p.add_argument("--normalize", default=None, action=argparse.BooleanOptionalAction,
                   help="l2-normalise sentence embeddings (default: when the run's objective compares them by cosine)")
    return p


def _exit_on_signal(signum: int, _frame: object) -> None:
    """SIGTERM as an exception, so `convert`'s cleanup runs before the process ends."""
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        out = convert(
            args.checkpoint_dir,
            args.out_dir,
            overwrite=args.overwrite,
            with_generator=args.with_generator,
            tokenizer_dir=args.tokenizer,
            shards_dir=args.shards,
            license_id=args.license,
            base_model=args.base_model,
            weights=args.weights,
            pooling=args.pooling,
            normalize=args.normalize,
        )
    except ExportWriteError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except (CheckpointError, ExportError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(summary(out)) if args.json else render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
