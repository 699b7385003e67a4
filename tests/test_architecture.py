"""The layout's promises, checked: no import cycles (module-level or inside functions), imports that run
down the package layers, small files, and one home for the concepts that used to be repeated."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "data_prep", "demo", "ds_configs", "benchmarks")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> project modules it imports anywhere in its body (function-level imports included)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (resolve(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.update(filter(None, (resolve(f"{node.module}.{a.name}") for a in node.names)))
        deps.discard(name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path [a, b, ..., a], or [] when the graph is acyclic."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycle = find_cycle(import_graph(_modules()))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


#: The package layers, bottom to top. A module may import from its own layer and the layers below it;
#: an import of a higher layer (function-level imports included) is an upward import. Each entry holds
#: module-name prefixes; every module of `PACKAGES` must fall in exactly one (the longest prefix wins).
#: Draw the package -> package edges with `python tests/test_architecture.py`.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # leaves every layer may use: errors and shared config checks + the YAML loader, the random streams,
    # collectives, machine probes, tokenizer probes, the restricted unpickler, atomic writes and file
    # hashes, intervals over seeds, report files (JSON / Markdown / PNG), the DeepSpeed engine files
    ("foundation", ("pipeline.config", "pipeline.seeding", "pipeline.distributed", "pipeline.capabilities",
                    "pipeline.tokenizer_checks", "pipeline.safe_load", "pipeline.io", "pipeline.stats",
                    "pipeline.report_files", "ds_configs")),
    ("data", ("pipeline.data",)),  # shards, reader, corruption views, the batch contract
    ("kernels", ("pipeline.kernels",)),  # the loss ops: torch reference (`functional`) + Triton kernels, `get_op`
    ("model", ("pipeline.model",)),  # encoders, heads, `ModelConfig`, HF name maps, warm starts
    ("objectives", ("pipeline.objectives",)),  # each objective on top of an encoder
    ("monitor", ("pipeline.monitor",)),  # in-training health and learning signals
    ("pretrain", ("pipeline.pretrain",)),  # `PretrainModel` = encoder + objectives, its constructor
    ("train", ("pipeline.train",)),  # `RunConfig` composing every section, the loop, `checkpoint/`, `phases/`
    ("export", ("pipeline.export",)),  # checkpoints -> Hugging Face directories
    ("eval", ("pipeline.eval",)),  # fine-tuning converted checkpoints
    ("tools", ("pipeline.status", "pipeline.launch_requeue")),  # commands that read what runs write
    ("study", ("pipeline.study",)),  # `cpt-study`: drives train, export and eval over many runs, reports them
    ("data_prep", ("data_prep",)),
    ("demo", ("demo",)),
    ("benchmarks", ("benchmarks",)),
]
_ROOT_MODULES = ("pipeline",)  # the bare package `__init__` (a docstring and `__version__`): foundation

#: (importer, imported) -> why this one import may run up the layers. At most two; each one a debt.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}  # none today; each entry would say why


def layer_of(module: str) -> int:
    """Index in `LAYERS` of `module` (longest matching prefix); KeyError for a module in no layer."""
    if module in _ROOT_MODULES:
        return 0
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise KeyError(module)
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs whose imported module sits in a higher layer than its importer."""
    return sorted((a, b) for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a))


def package_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], int]:
    """(layer, layer) -> number of module imports between two different layers."""
    edges: dict[tuple[str, str], int] = {}
    for a, deps in graph.items():
        for b in deps:
            la, lb = LAYERS[layer_of(a)][0], LAYERS[layer_of(b)][0]
            if la != lb:
                edges[la, lb] = edges.get((la, lb), 0) + 1
    return edges


def layer_of_name(name: str) -> int:
    return [n for n, _ in LAYERS].index(name)


def test_upward_imports_finds_a_planted_one():
    graph = {"pipeline.data.reader": {"pipeline.seeding"}, "pipeline.model.encoder": {"pipeline.train.loop"},
             "pipeline.train.loop": {"pipeline.model.encoder"}, "pipeline.seeding": set()}
    assert upward_imports(graph) == [("pipeline.model.encoder", "pipeline.train.loop")]
    with pytest.raises(KeyError):
        layer_of("pipeline.newpackage.thing")


def test_every_module_has_a_layer():
    lost = [m for m in _modules() if _layer_or_none(m) is None]
    assert not lost, f"modules in no layer (add their package to LAYERS in {Path(__file__).name}): {lost}"


def _layer_or_none(module: str) -> int | None:
    try:
        return layer_of(module)
    except KeyError:
        return None


def test_imports_run_down_the_layers():
    up = upward_imports(import_graph(_modules()))
    unexplained = [f"{a} -> {b}" for a, b in up if (a, b) not in ALLOWED_UPWARD]
    assert not unexplained, ("imports of a higher layer (move the leaf down, or the composition up; "
                             "layers bottom to top: " + " < ".join(name for name, _ in LAYERS) + "): "
                             + "; ".join(unexplained))
    stale = [f"{a} -> {b}" for a, b in ALLOWED_UPWARD if (a, b) not in up]
    assert not stale, f"ALLOWED_UPWARD entries that no longer import upward (delete them): {stale}"
    assert len(ALLOWED_UPWARD) <= 2


#: The rooms inside the `train` layer, bottom to top; a train module in none of them is one of its leaves
#: (settings, optimizer, engine, metrics, trackers, validation, guard, `run_meta`, ...), below them all. A
#: train module may import its own room, the rooms below it and the leaves, never a room above it.
TRAIN_ROOMS: list[tuple[str, tuple[str, ...]]] = [
    ("phases", ("pipeline.train.phases",)),  # planned from the sections the run config composes
    ("run config", ("pipeline.train.run_config", "pipeline.train.config_reference")),  # composes the phases
    ("checkpoint", ("pipeline.train.checkpoint",)),  # saves and resumes what the run config describes
    ("run", ("pipeline.train.loop", "pipeline.train.cli", "pipeline.train.__main__")),  # drives all of it
]


def train_room_of(module: str) -> int:
    """1 + index in `TRAIN_ROOMS` of a train module's room; 0 for a leaf of the train layer."""
    for index, (_, prefixes) in enumerate(TRAIN_ROOMS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index + 1
    return 0


def upward_train_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs of train modules whose imported module sits in a higher train room."""
    train = [m for m in graph if layer_of(m) == layer_of_name("train")]
    return sorted((a, b) for a in train for b in graph[a]
                  if layer_of(b) == layer_of_name("train") and train_room_of(b) > train_room_of(a))


def test_upward_train_imports_finds_a_planted_one():
    graph = {"pipeline.train.phases.schedule": {"pipeline.train.optim", "pipeline.train.checkpoint.tags"},
             "pipeline.train.checkpoint.tags": {"pipeline.train.run_config", "pipeline.train.phases.config"},
             "pipeline.train.optim": set(), "pipeline.train.run_config": set(), "pipeline.train.phases.config": set()}
    assert upward_train_imports(graph) == [("pipeline.train.phases.schedule", "pipeline.train.checkpoint.tags")]


def test_train_rooms_run_downward():
    up = [f"{a} -> {b}" for a, b in upward_train_imports(import_graph(_modules()))]
    assert not up, ("imports of a higher room of the train layer (rooms bottom to top: leaves < "
                    + " < ".join(name for name, _ in TRAIN_ROOMS) + "): " + "; ".join(up))


@pytest.mark.parametrize("package", PACKAGES + ("tests", "scripts", "slurm"))
def test_files_are_small(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*")
            if p.suffix in (".py", ".sh", ".sbatch") and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("pattern, home", [
    (r"^IGNORE_INDEX\s*=", "pipeline/data/batch.py"),
    (r"^(def|class) \w*(reseed|seed_init|sampling_seed|epoch_permutation|hash_uniform)\w*", "pipeline/seeding.py"),
    (r"^(class BatchPlan|def plan_batches)", "pipeline/data/config.py"),
    (r"^def (apex_available|triton_usable)", "pipeline/capabilities.py"),
    (r"^class ConfigError", "pipeline/config/checks.py"),
    (r"^def (broadcast_object|barrier|all_gather_rows|all_reduce_sum)\b", "pipeline/distributed.py"),
    (r"^def (fp32_logits|_logits_fp32)\b", "pipeline/kernels/functional.py"),
    (r"^def build_pretrain_model\b|(return|=)\s*PretrainModel\(", "pipeline/pretrain/build.py"),
    (r"^def _?(write_atomic|sha256_file|xxh3_file|hash_directory)\b", "pipeline/io.py"),
    (r"^def (t_quantile|mean_ci|difference_ci|format_ci)\b", "pipeline/stats.py"),
    (r"^def (write_report|write_json|markdown_table|save_figure|hardware_info)\b", "pipeline/report_files.py"),
    (r"^def last_error_line\b", "pipeline/train/exit_record.py"),
])
def test_one_home(pattern, home):
    """Each of these concepts is defined in exactly one module (they used to be repeated)."""
    found = sorted({str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                    if re.search(pattern, p.read_text(), re.MULTILINE)})
    assert found == [home]


def test_whole_file_writes_go_through_the_one_atomic_writer():
    """A temporary written with `write_text` and renamed by hand is `pipeline.io.write_atomic` without its
    fsync (six modules did that); binary and directory renames (shards, checkpoint tags, exports) keep
    their own code, since they stage more than one string."""
    pattern = re.compile(r"\.write_text\([^\n]*\)\n\s*os\.replace\(")
    found = sorted(str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                   if pattern.search(p.read_text()))
    assert found == ["pipeline/train/checkpoint/load.py"]  # COMPLETE.json inside a staged folder renamed whole


if __name__ == "__main__":  # the layer -> layer edges and the upward imports, for a reader of the layout
    _graph = import_graph(_modules())
    for (_a, _b), _n in sorted(package_edges(_graph).items(), key=lambda kv: (layer_of_name(kv[0][0]), kv[0][1])):
        print(f"{_a:>12} -> {_b:<12} {_n:3d}{'   UP' if layer_of_name(_b) > layer_of_name(_a) else ''}")
    for _a, _b in upward_imports(_graph):
        print(f"upward: {_a} -> {_b}")
