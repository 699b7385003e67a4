"""Data mixtures (`data.sources`, issue 38 item 6): proportions, order, resume, budgets, exhaustion,
refusals, and `data_prep.verify` over every source; plus the pin of the single-directory order.

The sources are synthetic shard directories written with the real shard writer and manifest: row r
of a source built from `base` is `[CLS] ... [SEP]` with length 3 + r % (seq_len - 3) and ids derived
from r, so every row is told apart by its ids and its token count is known."""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from data_prep.verify import main as verify_main
from data_prep.verify import verify_mixture
from pipeline.config.checks import ConfigError
from pipeline.train.run_config import load_config
from pipeline.data.config import BatchPlan, DataConfig
from pipeline.data.corruption import CorruptionCollator
from pipeline.data.mixture import MixtureDataset, SourceExhausted, open_run_data
from pipeline.data.reader import PretrainBatches, ShardDataset
from pipeline.data.shards import FORMAT_VERSION, MANIFEST_FILE, Manifest, id_dtype_for, shard_name, write_shard
from pipeline.io import write_atomic
from pipeline.data.sources import Interleave

SPECIALS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
SEED = 1234


def synthetic_shards(out: Path, rows: list[int], seq_len: int = 16, vocab: int = 100, base: int = 0,
                     tokenizer_hash: str = "synthetic") -> Path:
    """A shard directory (no tokenizer/ beside it) of `sum(rows)` rows in `len(rows)` shards."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = id_dtype_for(vocab)
    infos, total_tokens, row = [], 0, base
    for index, count in enumerate(rows):
        ids = np.zeros((count, seq_len), dtype=dtype)
        starts = np.zeros((count, seq_len), dtype=np.uint8)
        lengths = np.zeros(count, dtype=np.int32)
        for i in range(count):
            length = 3 + row % (seq_len - 3)
            ids[i, 0], ids[i, length - 1] = SPECIALS["cls"], SPECIALS["sep"]
            ids[i, 1:length - 1] = 5 + (row * 7 + np.arange(length - 2)) % (vocab - 5)
            starts[i, 1:length - 1] = 1
            lengths[i] = length
            total_tokens += length
            row += 1
        infos.append(write_shard(out / shard_name(index), ids, starts, lengths))
    manifest = Manifest(format_version=FORMAT_VERSION, seq_len=seq_len, vocab_size=vocab, special_tokens=dict(SPECIALS),
                        tokenizer_hash=tokenizer_hash, shards=infos, total_sequences=sum(rows),
                        total_tokens=total_tokens, sources=[], build_args={}, id_dtype=dtype.name)
    write_atomic(out / MANIFEST_FILE, manifest.to_json())
    return out


@pytest.fixture
def two_sources(tmp_path: Path) -> tuple[Path, Path]:
    """Source a: 170 rows in 3 shards; source b: 40 rows (small: the runs below re-read it)."""
    return synthetic_shards(tmp_path / "a", [70, 60, 40]), synthetic_shards(tmp_path / "b", [40], base=10_000)


def mixture(a: Path, b: Path, block: int = 64, **second) -> DataConfig:
    second = second or {"weight": 1.0}
    return DataConfig(sources=[{"path": str(a), "weight": 3.0}, {"path": str(b), **second}], mixture_block=block,
                      global_batch_size=16, micro_batch_size=4)


def source_of(dataset: MixtureDataset, rows: np.ndarray) -> np.ndarray:
    return (np.asarray(rows) >= len(dataset.datasets[0])).astype(np.int64)


def stream_hash(dataset, plan: BatchPlan, steps: int) -> str:
    """sha256 over every rank's (positions, ids, word starts) of `steps` steps: what the reader feeds."""
    digest = hashlib.sha256()
    for rank in range(plan.world_size):
        batches = PretrainBatches(dataset, None, plan, rank, seed=SEED)
        for step in range(steps):
            for micro in range(plan.grad_accum):
                positions = batches.positions(step * plan.global_batch_size, micro)
                ids, starts = dataset.take(batches.rows_at(positions))
                digest.update(positions.tobytes() + ids.tobytes() + starts.tobytes())
    return digest.hexdigest()


# ---- the single-directory path is unchanged --------------------------------------------------------
#: Recorded with the reader of commit 3c5423c (before data mixtures existed) on the same synthetic
#: directory: 157 rows in 3 shards, seed 1234, 2 ranks x accum 3 x micro 4, 20 steps (6 epochs).
PINNED_STREAM = "cbcf5c9fd8fe8fd347b5911b5a6e440d32e1c3ea3d027713511084c8d2d9fff5"
PINNED_ROWS = [34, 26, 154, 73, 153, 57, 147, 112, 0, 51, 93]  # rows at positions 0, 37, ..., 370


def test_single_directory_order_is_bitwise_what_it_was(tmp_path: Path) -> None:
    directory = synthetic_shards(tmp_path / "one", [70, 50, 37])
    dataset = open_run_data(DataConfig(shards_dir=str(directory)))  # the entry point a run uses
    assert type(dataset) is ShardDataset
    plan = BatchPlan(4, 3, 2)
    assert stream_hash(dataset, plan, 20) == PINNED_STREAM
    batches = PretrainBatches(dataset, None, plan, 0, seed=SEED)
    assert batches.rows_at(np.arange(0, 400, 37)).tolist() == PINNED_ROWS
    assert batches.source_metrics() == {}


# ---- proportions, order, resume --------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_source_mixture_hits_its_proportions(tmp_path: Path, seed: int) -> None:
    """70/30 over n positions of the default block (8192): the count of source b stays within 4
    binomial standard deviations of n p, |C - n p| <= 4 sqrt(n p (1 - p)) (a false failure has
    probability < 1e-4 for independent draws; the block interleave's within-block count is
    hypergeometric, narrower still), at every prefix checked; and at block boundaries it is exact."""
    a = synthetic_shards(tmp_path / "a", [300, 200])
    b = synthetic_shards(tmp_path / "b", [150], base=5000)
    data = DataConfig(sources=[{"path": str(a), "weight": 0.7}, {"path": str(b), "weight": 0.3}])
    dataset = open_run_data(data, check=False)
    assert dataset.plan.quotas == (5734, 2458)  # largest remainder of 0.7 / 0.3 x 8192
    batches = PretrainBatches(dataset, None, BatchPlan(8, 1, 1), 0, seed=seed)
    p = 0.3
    for n in (200, 1000, 5000, 20_000):
        from_b = int(source_of(dataset, batches.rows_at(np.arange(n))).sum())
        assert abs(from_b - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (n, from_b)
    order = Interleave(dataset.plan, seed)
    for blocks in (1, 2, 5):
        assert order.counts_before(blocks * 8192).tolist() == [blocks * 5734, blocks * 2458]
    assert batches.rows_at(np.arange(1000)).tolist() != \
        PretrainBatches(dataset, None, BatchPlan(8, 1, 1), 0, seed=seed + 10).rows_at(np.arange(1000)).tolist()


def test_mixture_stream_is_the_same_for_any_world_size_and_resumes_in_o1(two_sources) -> None:
    """The reader-level resume: batches from `consumed_samples=c` equal the uninterrupted stream's from
    c on (collated, masks included), and 1, 2 or 4 ranks read the same global stream."""
    dataset = open_run_data(mixture(*two_sources))

    def batches(world: int, rank: int, consumed: int = 0) -> PretrainBatches:
        collator = CorruptionCollator(("masked",), dataset.special_tokens, dataset.vocab_size, SEED)
        return PretrainBatches(dataset, collator, BatchPlan(16 // (4 * world), 4, world), rank, SEED,
                               consumed_samples=consumed)

    full = batches(1, 0)
    stream = [next(full) for _ in range(4 * 12)]  # 12 steps: b (40 rows, share 1/4) is re-read
    resumed = batches(1, 0, consumed=5 * 16)
    resumed.load_state_dict(full.state_dict() | {"consumed_samples": 5 * 16})
    for expected in stream[4 * 5:]:
        got = next(resumed)
        assert all(np.array_equal(expected[k].numpy(), got[k].numpy()) for k in expected)
    one = np.concatenate([b["sample_index"].numpy() for b in stream])
    for world in (2, 4):
        readers = [batches(world, r) for r in range(world)]
        merged = np.concatenate([readers[r].rows_at(readers[r].positions(step * 16, m)) for step in range(12)
                                 for m in range(readers[0].grad_accum) for r in range(world)])
        assert merged.tolist() == full.rows_at(one).tolist()


def test_worker_processes_read_the_same_mixture_batches(two_sources) -> None:
    """`num_workers > 0`: the mixture dataset is pickled into DataLoader workers (its caches rebuilt
    there) and they collate exactly the batches of the training process."""
    dataset = open_run_data(mixture(*two_sources))

    def batches(workers: int) -> list:
        collator = CorruptionCollator(("masked",), dataset.special_tokens, dataset.vocab_size, SEED)
        reader = PretrainBatches(dataset, collator, BatchPlan(4, 4, 1), 0, SEED, consumed_samples=48,
                                 num_workers=workers)
        return [next(reader) for _ in range(4 * 6)]

    for inline, worker in zip(batches(0), batches(1)):
        assert all(np.array_equal(inline[k].numpy(), worker[k].numpy()) for k in inline)


def test_a_source_is_re_read_in_a_new_order_each_pass_and_its_counters_are_exact(two_sources) -> None:
    dataset = open_run_data(mixture(*two_sources))
    batches = PretrainBatches(dataset, None, BatchPlan(4, 4, 1), 0, SEED)
    rows = batches.rows_at(np.arange(640))  # b: 160 of them, 4 passes over its 40 rows
    from_b = rows[source_of(dataset, rows) == 1]
    assert len(from_b) == 160
    passes = [from_b[i * 40:(i + 1) * 40] for i in range(4)]
    for one_pass in passes:  # each pass reads every row of b exactly once
        assert sorted(one_pass.tolist()) == list(range(170, 210))
    assert len({tuple(p.tolist()) for p in passes}) == 4  # ...in a new order each time
    for consumed in (0, 16, 208, 640):  # the logged counters: brute force over the rows read
        batches.consumed_samples = consumed
        metrics = batches.source_metrics()
        read = rows[:consumed]
        lengths = [dataset.datasets[0].lengths(), dataset.datasets[1].lengths()]
        assert metrics["data/a/samples"] + metrics["data/b/samples"] == consumed
        assert metrics["data/b/samples"] == int((source_of(dataset, read) == 1).sum())
        assert metrics["data/a/tokens"] == int(lengths[0][read[read < 170]].sum())
        assert metrics["data/b/tokens"] == int(lengths[1][read[read >= 170] - 170].sum())


def test_a_token_budget_becomes_a_share_of_the_run(two_sources) -> None:
    """b's budget of 1,200 tokens over a 480-sample run: share = (1200 / mean length) / 480, and the
    tokens it gives over the run come within a few sequences' tokens of the budget."""
    a, b = two_sources
    mean_b = ShardDataset(b).manifest.total_tokens / 40
    data = mixture(a, b, block=480, tokens=1200)
    data.check_shards(BatchPlan(4, 4, 1), total_steps=30, seed=SEED)
    dataset = open_run_data(data, run_samples=480)
    assert dataset.plan.shares[1] == pytest.approx(1200 / mean_b / 480)
    got = dataset.source_metrics(SEED, 480)["data/b/tokens"]
    assert abs(got - 1200) <= 2 * 16, got  # the share is realised to one position of 480 and to whole sequences
    only_budgets = DataConfig(sources=[{"path": str(a), "tokens": 3000}, {"path": str(b), "tokens": 1000}])
    shares = open_run_data(only_budgets, run_samples=480, check=False).plan.shares
    mean_a = ShardDataset(a).manifest.total_tokens / 170
    assert shares[1] / shares[0] == pytest.approx((1000 / mean_b) / (3000 / mean_a))


def test_on_exhausted_stop_refuses_the_run_naming_the_step(two_sources) -> None:
    a, b = two_sources
    data = mixture(a, b, weight=1.0, on_exhausted="stop")
    plan = BatchPlan(4, 4, 1)
    data.check_shards(plan, total_steps=10, seed=SEED)  # 160 samples: 40 of b, exactly all of them
    dataset = open_run_data(data, check=False)
    batches = PretrainBatches(dataset, None, plan, 0, SEED)
    position = Interleave(dataset.plan, SEED).position_of(1, 40)  # the 41st sample of b
    with pytest.raises(ConfigError, match=rf"data.sources\[1\] \({b}, on_exhausted: stop\): its 40 sequences run out "
                                          rf"at step {position // 16 + 1} of train.total_steps=40"):
        data.check_shards(plan, total_steps=40, seed=SEED)
    assert source_of(dataset, batches.rows_at(np.arange(position))).sum() == 40  # everything before: allowed
    with pytest.raises(SourceExhausted, match=r"data.sources\[1\].*all 40 sequences are used up"):
        batches.rows_at(np.arange(position + 1))


# ---- refusals, before compute ----------------------------------------------------------------------
@pytest.mark.parametrize("entry, message", [
    ({"path": "x", "weight": 0}, r"data.sources\[1\].weight=0: must be a number > 0"),
    ({"path": "x", "weight": -1.5}, r"data.sources\[1\].weight=-1.5"),
    ({"path": "x", "weight": "lots"}, r"data.sources\[1\].weight='lots'"),
    ({"path": "x"}, r"data.sources\[1\] \(x\): give exactly one of weight"),
    ({"path": "x", "weight": 1, "tokens": 5}, r"exactly one of weight"),
    ({"path": "x", "tokens": 2.5}, r"data.sources\[1\].tokens=2.5"),
    ({"path": "x", "wieght": 1}, r"data.sources\[1\].wieght: unknown key \(did you mean 'weight'\?\)"),
    ({"path": "x", "weight": 1, "on_exhausted": "halt"}, r"on_exhausted='halt'"),
    ({"path": "dir/a", "weight": 1}, r"name 'a' is used by 2 sources"),
    ({"weight": 1}, r"data.sources\[1\].path: required"),
])
def test_bad_source_entries_are_refused(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(sources=[{"path": "a", "weight": 1}, entry]).check()


def test_sources_and_shards_dir_are_mutually_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.sources and data.shards_dir=.* are both set: they are mutually"):
        load_config("tiny-mlm", [f"data.shards_dir={tmp_path}", f"data.sources=[{{path: {tmp_path}, weight: 1}}]"])
    with pytest.raises(ConfigError, match=r"data.sources=\[\]|data.shards_dir is required"):
        load_config("tiny-mlm", []).data.check_shards(BatchPlan(4, 2, 1))


def test_sources_with_another_tokenizer_or_seq_len_are_refused_by_path(tmp_path: Path) -> None:
    a = synthetic_shards(tmp_path / "a", [50])
    other = synthetic_shards(tmp_path / "other", [50], tokenizer_hash="another")
    longer = synthetic_shards(tmp_path / "longer", [50], seq_len=32)
    bigger = synthetic_shards(tmp_path / "bigger", [50], vocab=300)
    plan = BatchPlan(4, 4, 1)
    for second, what in ((other, "tokenizer_hash another vs synthetic"), (bigger, "vocab_size 300 vs 100")):
        data = mixture(a, second)
        with pytest.raises(ConfigError, match=rf"data.sources\[1\].path={second} was built with another tokenizer than "
                                              rf"data.sources\[0\].path={a} \({what}\)"):
            data.check_shards(plan, 10)
    with pytest.raises(ConfigError, match=rf"data.sources\[1\].path={longer} has seq_len=32, data.sources\[0\].path="):
        mixture(a, longer).check_shards(plan, 10)
    with pytest.raises(ConfigError, match=rf"data.sources\[1\].path={tmp_path / 'nope'}: no such directory"):
        mixture(a, tmp_path / "nope").check_shards(plan, 10)
    copy = synthetic_shards(tmp_path / "copy", [50])
    budget = DataConfig(sources=[{"path": str(a), "weight": 1}, {"path": str(copy), "tokens": 100_000}],
                        global_batch_size=16, micro_batch_size=4)
    with pytest.raises(ConfigError, match=r"data.sources\[1\].tokens=100,000: the token budgets need .* samples, the "
                                          r"whole run has 160"):
        budget.check_shards(plan, 10)


def test_a_damaged_shard_of_any_source_stops_the_run_naming_its_field(two_sources) -> None:
    a, b = two_sources
    shard = b / shard_name(0)
    raw = bytearray(shard.read_bytes())
    raw[-200] ^= 0xFF  # same size, other bytes: only the hash check (on opening, before any step) sees it
    shard.write_bytes(bytes(raw))
    data = mixture(a, b)
    data.check_shards(BatchPlan(4, 4, 1), 10)  # the cheap layout checks pass
    with pytest.raises(ConfigError, match=rf"data.sources\[1\].path={b}: {shard}: its xxh3-64 hash differs"):
        open_run_data(data)


# ---- cpt-verify over every source ------------------------------------------------------------------
def build_real(out: Path, modules: tuple[str, ...], tokenizer: Path) -> Path:
    """Shards built by `data_prep.build_shards` from the docstrings of `modules` (real text, real tokenizer)."""
    from data_prep.build_shards import build_shards
    from tests.fixtures_data import TINY_SEQ_LEN, stdlib_documents, write_corpus

    corpus = write_corpus(out.with_suffix(".txt"), stdlib_documents(modules))
    build_shards([corpus], tokenizer, out, seq_len=TINY_SEQ_LEN, shard_size_mb=0.02, num_proc=1, progress=False)
    return out


def test_verify_checks_every_source_and_that_they_form_one_mixture(tiny_tokenizer_dir: Path, tmp_path: Path,
                                                                    capsys) -> None:
    from data_prep.train_tokenizer import train_tokenizer

    a = build_real(tmp_path / "wiki", ("argparse", "json", "logging"), tiny_tokenizer_dir)
    b = build_real(tmp_path / "books", ("textwrap", "queue"), tiny_tokenizer_dir)
    assert verify_mixture([a, b]) == []
    assert verify_main(["--mixture", str(a), str(b)]) == 0
    assert "OK mixture of 2 directories: one tokenizer, seq_len 64" in capsys.readouterr().out
    own = train_tokenizer([a.with_suffix(".txt")], tmp_path / "own_tokenizer", vocab_size=500, progress=False)
    other = build_real(tmp_path / "other", ("textwrap",), own)
    assert verify_main([str(a), str(other)]) == 0  # unrelated directories: each on its own
    assert verify_main(["--mixture", str(a), str(other)]) == 1
    assert f"FAIL {other} was built with another tokenizer than {a} (tokenizer_hash" in capsys.readouterr().err
    sources = f"data.sources=[{{path: {a}, weight: 2}}, {{path: {b}, weight: 1}}]"
    assert verify_main(["--config", "tiny-mlm", sources]) == 0
    out = capsys.readouterr().out
    assert f"OK {a}:" in out and f"OK {b}:" in out and "OK mixture of 2 directories" in out
    shard = b / shard_name(0)
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF  # a flipped byte in the second source
    shard.write_bytes(bytes(raw))
    assert verify_main(["--config", "tiny-mlm", sources]) == 1
    err = capsys.readouterr().err
    assert f"FAIL {shard}: sha256 mismatch" in err and f"{b}: 1 problem(s)" in err
