"""The layout's promises, checked: no import cycles (module-level or inside functions), small files,
and one home for the concepts that used to be repeated."""
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


@pytest.mark.parametrize("package", PACKAGES + ("tests", "scripts", "slurm"))
def test_files_are_small(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*")
            if p.suffix in (".py", ".sh", ".sbatch") and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("pattern, home", [
    (r"^IGNORE_INDEX\s*=", "pipeline/batch.py"),
    (r"^(def|class) \w*(reseed|seed_init|sampling_seed|epoch_permutation|hash_uniform)\w*", "pipeline/seeding.py"),
    (r"^(class BatchPlan|def plan_batches)", "pipeline/data/config.py"),
    (r"^def (apex_available|triton_usable)", "pipeline/capabilities.py"),
    (r"^class ConfigError", "pipeline/config/checks.py"),
    (r"^def (broadcast_object|barrier|all_gather_rows|all_reduce_sum)\b", "pipeline/distributed.py"),
    (r"^def (fp32_logits|_logits_fp32)\b", "pipeline/objectives/functional.py"),
    (r"^def build_pretrain_model\b|(return|=)\s*PretrainModel\(", "pipeline/model/build.py"),
])
def test_one_home(pattern, home):
    """Each of these concepts is defined in exactly one module (they used to be repeated)."""
    found = sorted({str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                    if re.search(pattern, p.read_text(), re.MULTILINE)})
    assert found == [home]
