"""`data.sources`: a mixture of shard directories — its spec, its checks, and its sample order.

A run reads either one directory (`data.shards_dir`, the order of `pipeline.data.reader`) or a
mixture (`data.sources`, never both). Each source is

    - path: DIR            a directory written by `data_prep.build_shards`
      weight: 0.7          its share of the samples (weights are normalised), or
      tokens: 2.0e9        a token budget: about this many (non-padding) tokens over the run
      name: wiki           metrics key `data/<name>/...` (default: the directory's name)
      on_exhausted: repeat what to do when the run needs more sequences than it holds (below)

and all sources share one tokenizer (same `tokenizer_hash`, vocabulary, special-token ids) and one
`seq_len`; each directory gets the checks a single `data.shards_dir` gets, all before compute.

Shares. Weights are normalised to shares w_s. A token budget N_s becomes a share of the run's samples
T (`train.total_steps` x global batch): w_s = (N_s / mean tokens per sequence of s) / T. With only
budgets, shares are proportional to those sample counts; mixed with weights, the budgets take their
shares first (their sum must stay below 1) and the weighted sources share the rest by weight.

Interleave (our choice; the public recipes only name proportions). The stream is cut into blocks of
B = `data.mixture_block` positions. Every block holds exactly q_s positions of source s (the largest-
remainder apportionment of w_s x B, so sum q_s = B), at places given by a permutation of the block's
labels drawn from (seed, block). Hence
  * position p is source s = layout(p // B)[p % B], and the number of samples of s before p is
    C_s(p) = (p // B) q_s + #{s in the block before p}: O(1) in p, so resume stays O(1) (state =
    consumed samples, as for one directory), rank slicing is unchanged, and any world size reads
    the same stream;
  * proportions are exact at every block boundary (|C_s(p) - p q_s / B| < q_s <= B) and within a
    block the count is hypergeometric, i.e. tighter than the binomial spread of independent draws
    (Megatron's blended dataset instead chooses greedily per position and stores the whole index);
  * shares are realised as q_s / B, within 1/B of w_s (the start-up log prints both).
Within source s, its k-th sample is row perm_s(k // N_s)[k % N_s], one fresh permutation per pass
(`pipeline.seeding.epoch_permutation`, keyed by a seed derived from (seed, s)).

Exhaustion. When the run needs more than the N_s sequences of a source, `on_exhausted: repeat` (the
default) starts another pass over it with a new permutation, as a single directory does at an epoch
boundary; the start-up log names each source's passes over the run. `on_exhausted: stop` refuses
the run before any compute, naming the step at which the source runs out (so that step count can be
set as `train.total_steps`), and the reader refuses to read past its end.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from pipeline.config.checks import ConfigError, check_known_keys, did_you_mean
from pipeline.data.shards import TOKENIZER_SUBDIR, Manifest, read_manifest

SOURCE_KEYS = ("path", "weight", "tokens", "name", "on_exhausted")
ON_EXHAUSTED = ("repeat", "stop")
DEFAULT_MIXTURE_BLOCK = 8192
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_LAYOUT_KEY = 0x6D6978  # "mix": keeps the interleave's random stream apart from every other (seed, ...) stream


@dataclass(frozen=True)
class SourceSpec:
    """One checked entry of `data.sources`."""

    index: int
    path: str
    name: str
    weight: Optional[float]
    tokens: Optional[int]
    on_exhausted: str

    @property
    def where(self) -> str:
        return f"data.sources[{self.index}]"


def parse_sources(raw: Any, block: int) -> list[SourceSpec]:
    """Stage-1 checks of `data.sources` (no filesystem): every entry a mapping with a `path` and
    exactly one of `weight` (> 0) / `tokens` (> 0), known keys, unique names."""
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(f"data.sources={raw!r}: expected a non-empty list of {{path, weight | tokens}} mappings")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ConfigError(f"data.mixture_block={block!r}: must be an integer >= 1")
    specs: list[SourceSpec] = []
    for index, entry in enumerate(raw):
        where = f"data.sources[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}={entry!r}: expected a mapping with path and weight or tokens")
        check_known_keys(entry, SOURCE_KEYS, where)
        path = entry.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.path: required (a directory written by data_prep.build_shards)")
        if ("weight" in entry) == ("tokens" in entry):
            raise ConfigError(f"{where} ({path}): give exactly one of weight (a share) or tokens (a token budget)")
        weight = tokens = None
        if "weight" in entry:
            weight = entry["weight"]
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight <= 0:
                raise ConfigError(f"{where}.weight={weight!r}: must be a number > 0 (drop the source to leave it out)")
            weight = float(weight)
        else:
            tokens = entry["tokens"]
            if isinstance(tokens, float) and tokens.is_integer():
                tokens = int(tokens)
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
                raise ConfigError(f"{where}.tokens={entry['tokens']!r}: must be a whole number of tokens > 0")
        name = entry.get("name", Path(path.rstrip("/")).name)
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{where}.name={name!r}: letters, digits, '_', '.', '-' only (it is a metrics key)")
        on_exhausted = entry.get("on_exhausted", "repeat")
        if on_exhausted not in ON_EXHAUSTED:
            raise ConfigError(f"{where}.on_exhausted={on_exhausted!r}: must be one of {list(ON_EXHAUSTED)}"
                              f"{did_you_mean(str(on_exhausted), ON_EXHAUSTED)}")
        specs.append(SourceSpec(index, path, name, weight, tokens, on_exhausted))
    names = [s.name for s in specs]
    for spec in specs:
        if names.count(spec.name) > 1:
            raise ConfigError(f"{spec.where}: name {spec.name!r} is used by {names.count(spec.name)} sources; give "
                              "each a distinct name (data.sources[i].name)")
    return specs


@dataclass(frozen=True)
class MixturePlan:
    """Checked sources with their sizes, shares and per-block quotas (see the module doc)."""

    sources: tuple[SourceSpec, ...]
    sequences: tuple[int, ...]
    tokens: tuple[int, ...]
    shares: tuple[float, ...]
    quotas: tuple[int, ...]
    block: int

    def describe(self, run_samples: Optional[int]) -> list[str]:
        """One line per source for the start-up log: share asked / realised, passes over the run."""
        lines = []
        for s, spec in enumerate(self.sources):
            passes = ""
            if run_samples:
                needed = run_samples * self.quotas[s] / self.block
                passes = f", {needed / self.sequences[s]:.2f} passes over the run (on_exhausted: {spec.on_exhausted})"
            lines.append(f"{spec.where} {spec.name} ({spec.path}): {self.sequences[s]:,} sequences, share "
                         f"{self.shares[s]:.4f} -> {self.quotas[s]}/{self.block} per block{passes}")
        return lines


def apportion(shares: Sequence[float], block: int) -> list[int]:
    """Largest-remainder apportionment of `block` positions by `shares` (sum 1): sum == block."""
    raw = np.asarray(shares, dtype=np.float64) * block
    quotas = np.floor(raw).astype(np.int64)
    left = block - int(quotas.sum())
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - quotas[i]), i))  # ties: the earlier source
    for i in order[:left]:
        quotas[i] += 1
    return [int(q) for q in quotas]


def plan_mixture(specs: Sequence[SourceSpec], sequences: Sequence[int], tokens: Sequence[int], block: int,
                 run_samples: Optional[int]) -> MixturePlan:
    """Shares and quotas from weights and token budgets (the module doc's rules); `run_samples` is the
    run's sample count, needed when a source has a token budget."""
    budgets = {}
    for s, spec in enumerate(specs):
        if spec.tokens is not None:
            if not run_samples:
                raise ConfigError(f"{spec.where}.tokens: a token budget needs the run's length (train.total_steps)")
            budgets[s] = spec.tokens / (tokens[s] / sequences[s])  # samples of mean length
    weights = {s: spec.weight for s, spec in enumerate(specs) if spec.weight is not None}
    shares = [0.0] * len(specs)
    if not weights:
        total = sum(budgets.values())
        for s, samples in budgets.items():
            shares[s] = samples / total
    else:
        budget_share = sum(budgets.values()) / run_samples if budgets else 0.0
        if budget_share >= 1:
            fields = ", ".join(f"{specs[s].where}.tokens={specs[s].tokens:,}" for s in budgets)
            raise ConfigError(f"{fields}: the token budgets need {sum(budgets.values()):,.0f} samples, the whole run has "
                              f"{run_samples:,} (train.total_steps x global batch): lower them, or give weights instead")
        for s, samples in budgets.items():
            shares[s] = samples / run_samples
        weight_sum = sum(weights.values())
        for s, weight in weights.items():
            shares[s] = (1.0 - budget_share) * weight / weight_sum
    quotas = apportion(shares, block)
    for s, spec in enumerate(specs):
        if quotas[s] == 0:
            raise ConfigError(f"{spec.where} ({spec.path}): share {shares[s]:.2e} is below one position per block of "
                              f"data.mixture_block={block}; raise data.mixture_block (>= {int(np.ceil(1 / shares[s]))}) "
                              "or the source's weight")
    return MixturePlan(tuple(specs), tuple(int(n) for n in sequences), tuple(int(t) for t in tokens), tuple(shares),
                       tuple(quotas), block)


def mixture_hash(content_hashes: Sequence[str], plan: MixturePlan) -> str:
    """The mixture's data identity (checkpoints record it like a manifest hash): the sources' manifest
    content hashes, names and realised quotas, in order; paths are left out (moving data is no change)."""
    blob = json.dumps({"sources": [[spec.name, h, q] for spec, h, q in zip(plan.sources, content_hashes, plan.quotas)],
                       "block": plan.block}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def mixture_identity(data: Any, total_steps: int) -> str:
    """The data hash a run of `total_steps` steps on this mixture records (`DataConfig.check_shards`),
    from the manifests alone: what `--resume` compares before any check (a token budget's share, and
    so this hash, depends on the run's length)."""
    specs = parse_sources(data.sources, data.mixture_block)
    manifests = [read_manifest(spec.path) for spec in specs]
    plan = plan_mixture(specs, [m.total_sequences for m in manifests], [m.total_tokens for m in manifests],
                        data.mixture_block, total_steps * data.global_batch_size)
    return mixture_hash([m.content_hash for m in manifests], plan)

def source_identities(content_hashes: Sequence[str]) -> list[str]:
    """What each source *is* (its data, not its display name): its manifest's content hash, with the
    occurrence number appended when two sources read the same data ("h", "h#1", ...)."""
    seen: dict[str, int] = {}
    out = []
    for h in content_hashes:
        out.append(h if not seen.get(h) else f"{h}#{seen[h]}")
        seen[h] = seen.get(h, 0) + 1
    return out


def match_sources(before: Sequence[dict], after: Sequence[dict]) -> list[Optional[int]]:
    """For each source of `after`, the index of the same source in `before` (each a list of
    `{name, identity, path}`), or None for a new one: the same data (`identity`) first, else the same
    path at the same index (its contents changed in place), else the same name (records written before
    identities were). A renamed source is thus the same source: its counters go on."""
    matched: list[Optional[int]] = [None] * len(after)
    free = set(range(len(before)))
    rules = (lambda i, j: bool(after[i].get("identity")) and after[i].get("identity") == before[j].get("identity"),
             lambda i, j: i == j and bool(after[i].get("path")) and after[i].get("path") == before[j].get("path"),
             lambda i, j: not before[j].get("identity") and after[i].get("name") == before[j].get("name"))
    for rule in rules:
        for i in range(len(after)):
            if matched[i] is None:
                j = next((j for j in sorted(free) if rule(i, j)), None)
                if j is not None:
                    matched[i] = j
                    free.discard(j)
    return matched


def _described(specs: Sequence[SourceSpec]) -> list[dict]:
    """`{name, identity, path}` of each spec, the identity from its manifest ("" where unreadable)."""
    hashes = []
    for spec in specs:
        try:
            hashes.append(read_manifest(spec.path).content_hash or "")
        except (OSError, ValueError):
            hashes.append("")
    return [{"name": spec.name, "identity": ident if h else "", "path": spec.path}
            for spec, h, ident in zip(specs, hashes, source_identities(hashes))]


def source_seed(seed: int, source: int) -> int:
    """The seed of source `source`'s own pass permutations: derived from (run seed, source index)."""
    digest = hashlib.sha256(f"mixture-source/{seed}/{source}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Interleave:
    """Which source each stream position reads, and its index within that source (module doc)."""

    def __init__(self, plan: MixturePlan, seed: int) -> None:
        self.plan, self.seed = plan, seed
        self.quotas = np.asarray(plan.quotas, dtype=np.int64)
        self._labels = np.repeat(np.arange(len(plan.quotas), dtype=np.int16), plan.quotas)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def layout(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position of `block`, its rank among that source's positions in the block)."""
        if block not in self._blocks:
            if len(self._blocks) >= 2:  # a step rarely spans more than two blocks; more only recomputes
                self._blocks.pop(min(self._blocks))
            labels = np.random.default_rng([self.seed, _LAYOUT_KEY, block]).permutation(self._labels)
            ranks = np.empty(len(labels), dtype=np.int64)
            for s in range(len(self.quotas)):
                ranks[labels == s] = np.arange(self.quotas[s])
            self._blocks[block] = (labels, ranks)
        return self._blocks[block]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of each stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        blocks, offsets = np.divmod(positions, self.plan.block)
        sources = np.empty(len(positions), dtype=np.int64)
        index = np.empty(len(positions), dtype=np.int64)
        for block in np.unique(blocks):
            selected = blocks == block
            labels, ranks = self.layout(int(block))
            sources[selected] = labels[offsets[selected]]
            index[selected] = int(block) * self.quotas[sources[selected]] + ranks[offsets[selected]]
        return sources, index

    def counts_before(self, position: int) -> np.ndarray:
        """Samples of each source among stream positions [0, position): C_s(position)."""
        block, offset = divmod(int(position), self.plan.block)
        labels, _ = self.layout(block)
        return block * self.quotas + np.bincount(labels[:offset], minlength=len(self.quotas))

    def position_of(self, source: int, index: int) -> int:
        """The stream position of source `source`'s sample number `index` (0-based)."""
        block, rank = divmod(int(index), int(self.quotas[source]))
        labels, _ = self.layout(block)
        return block * self.plan.block + int(np.flatnonzero(labels == source)[rank])


def check_exhaustion(plan: MixturePlan, seed: int, run_samples: int, global_batch: int, total_steps: int,
                     length_field: str = "train.total_steps", first_step: int = 0) -> None:
    """`on_exhausted: stop`: refuse (before compute) a run that would need more sequences of a source
    than it holds, naming the step that would first read past its end. `length_field` names the
    length being checked (`train.total_steps`, or a phase's `phases.<i>.steps`) and `first_step`
    the steps before it (a phase's stream starts after them: the step named is the run's)."""
    order = Interleave(plan, seed)
    for s, spec in enumerate(plan.sources):
        if spec.on_exhausted != "stop" or order.counts_before(run_samples)[s] <= plan.sequences[s]:
            continue
        step = order.position_of(s, plan.sequences[s]) // global_batch + 1
        where = f"step {step} of {length_field}={total_steps}" if not first_step else \
            f"step {first_step + step} (step {step} of {length_field}={total_steps})"
        raise ConfigError(
            f"{spec.where} ({spec.path}, on_exhausted: stop): its {plan.sequences[s]:,} sequences run out at {where}; "
            f"stop there ({length_field}={step - 1}), lower its share, or set {spec.where}.on_exhausted=repeat to "
            "start another pass over it")


def data_directories(data: Any) -> list[str]:
    """The shard directories a data spec (`DataConfig`-like) reads: `shards_dir`, or every source's path."""
    if data.sources:
        return [spec.path for spec in parse_sources(data.sources, data.mixture_block)]
    return [data.shards_dir]


def mixture_mismatches(named: Sequence[tuple[str, str, Manifest]]) -> list[str]:
    """What keeps directories from being one mixture: each `(label, path, manifest)` against the first,
    one line per directory whose tokenizer (hash, vocabulary, special-token ids) or seq_len differs.
    Training (`DataConfig.check_sources`) and `python -m data_prep.verify --mixture` both use it."""
    (first_label, first_path, ref), problems = named[0], []
    for label, _, manifest in named[1:]:
        for what, mine, theirs in (("tokenizer_hash", manifest.tokenizer_hash, ref.tokenizer_hash),
                                   ("vocab_size", manifest.vocab_size, ref.vocab_size),
                                   ("special_tokens", manifest.special_tokens, ref.special_tokens)):
            if mine != theirs:
                problems.append(f"{label} was built with another tokenizer than {first_label} ({what} {mine} vs "
                                f"{theirs}); a mixture needs one tokenizer: rebuild it with data_prep.build_shards "
                                f"--tokenizer {Path(first_path) / TOKENIZER_SUBDIR}")
                break
        else:
            if manifest.seq_len != ref.seq_len:
                problems.append(f"{label} has seq_len={manifest.seq_len}, {first_label} has {ref.seq_len}; a mixture "
                                "needs one seq_len: rebuild one of them")
    return problems


def interleave_change(old: Any, old_samples: int, new: Any, new_samples: int, continued: bool = False) -> Optional[str]:
    """Why a stream read up to some position under data spec `old` (`DataConfig`-like, planned over
    `old_samples`) cannot go on under `new` (over `new_samples`), or None. The interleave is a pure
    function of the position from the stream's first sample (module doc): other quotas, block, or
    sources re-place every position already read, so a resume would skip rows of one source and read
    rows of another again, and the per-source counters would jump. With `continued` (the checkpoint
    recorded its read position: `pipeline.data.mixture.MixtureDataset.continue_stream` starts a new
    segment there) only a source that moved to another index is a problem (its pass order is keyed
    by its index). A source's contents are the data identity's business; None also where a manifest
    is unreadable (the data checks name that)."""
    if not old.sources and not new.sources:
        return None
    if bool(old.sources) != bool(new.sources):
        what = "a data.sources mixture" if old.sources else "one directory (data.shards_dir)"
        return f"data.sources: the stream read so far is {what}; its positions cannot be continued by the other kind"
    try:
        plans = []
        for data, samples in ((old, old_samples), (new, new_samples)):
            specs = parse_sources(data.sources, data.mixture_block)
            manifests = [read_manifest(spec.path) for spec in specs] if not continued else []
            plans.append(specs if continued else
                         plan_mixture(specs, [m.total_sequences for m in manifests],
                                      [m.total_tokens for m in manifests], data.mixture_block, samples))
    except (ConfigError, OSError, ValueError):
        return None
    if continued:  # a source is its data (`match_sources`), whatever its name now
        before, after = _described(plans[0]), _described(plans[1])
        for i, j in enumerate(match_sources(before, after)):
            if j is not None and j != i:
                renamed = f" (named {before[j]['name']} then)" if before[j]["name"] != after[i]["name"] else ""
                return (f"data.sources[{i}]: source {after[i]['name']} was data.sources[{j}]{renamed} (a source keeps "
                        "its index: its pass order is drawn from it; add new sources at the end)")
        return None
    before, after = plans
    if before.block != after.block:
        return f"data.mixture_block: {before.block} -> {after.block}"
    names = [s.name for s in before.sources]
    if names != [s.name for s in after.sources]:
        return f"data.sources: the sources (in order) were {names}, now {[s.name for s in after.sources]}"
    for s, spec in enumerate(after.sources):
        if before.quotas[s] != after.quotas[s]:
            field = f"{spec.where}.{'tokens' if spec.tokens is not None else 'weight'}"
            budget = (" (a token budget is a share of the samples it is planned over: train.total_steps, or the "
                      "phase's steps, x global batch)") if spec.tokens is not None or before.sources[s].tokens else ""
            return (f"{field}: source {spec.name}'s share moves from {before.quotas[s]} to {after.quotas[s]} of every "
                    f"{after.block} positions{budget}")
    return None
