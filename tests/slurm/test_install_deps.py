"""`scripts/test.sh` installs system packages only when the selected tests need them (issue 58): SLURM and
munge go in system-wide only when the selection includes tests marked slurm (pytest decides, through
`tests/selected_markers.py`), the script says so before it installs, and CPT_NO_SYSTEM_PACKAGES=1
declines, after which the slurm tests skip naming it. No test here installs anything."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.slurm import cluster

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install_test_deps.sh"


def _collect(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "counts.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.selected_markers", *args],
                          cwd=REPO, env={**os.environ, "CPT_SELECTED_MARKERS": str(out)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-2000:] + proc.stderr[-2000:]  # 5: every test deselected
    return json.loads(out.read_text())


def test_pytest_counts_the_selected_slurm_tests(tmp_path):
    cluster_tests = _collect(tmp_path, "tests/slurm/test_cluster.py")
    assert cluster_tests["selected"] > 0 and cluster_tests["slurm"] == cluster_tests["selected"]
    assert _collect(tmp_path, "-m", "not slurm", "tests/slurm/test_cluster.py")["slurm"] == 0
    scripts_only = _collect(tmp_path, "tests/slurm/test_scripts.py", "tests/slurm/test_cluster.py", "-k", "signal_lead")
    assert scripts_only == {"selected": 1, "slurm": 0}


def _bin_without_apt(tmp_path: Path) -> Path:
    """A PATH with the few tools the script runs and no apt-get / dpkg-query: "another distribution",
    so a branch that would install says so instead of installing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mktemp", "rm", "cat", "id", "grep"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return bin_dir


def _install_deps(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), str(SCRIPT), *args], cwd=tmp_path,
                          env={"PATH": str(_bin_without_apt(tmp_path)), "PYTHON": sys.executable,
                               "HOME": str(tmp_path), **env},
                          capture_output=True, text=True, timeout=300)


def test_a_selection_without_slurm_tests_installs_nothing(tmp_path):
    proc = _install_deps(tmp_path, "-m", "not slurm", "tests/slurm/test_cluster.py")
    assert proc.returncode == 0, proc.stderr
    assert "no selected test is marked slurm: no system packages needed, nothing installed" in proc.stdout
    assert "apt" not in proc.stdout + proc.stderr  # never reached the package step


def test_a_selection_pytest_cannot_collect_installs_nothing(tmp_path):
    proc = _install_deps(tmp_path, "tests/no_such_test_file.py")
    assert proc.returncode == 0, proc.stderr
    assert "pytest could not collect that selection" in proc.stdout and "apt" not in proc.stdout + proc.stderr


def test_a_selection_with_slurm_tests_goes_on_to_the_package_step(tmp_path):
    proc = _install_deps(tmp_path, "tests/slurm/test_cluster.py")
    assert proc.returncode == 0, proc.stderr
    assert "collecting the selected tests" in proc.stdout and "nothing installed" not in proc.stdout
    assert "no apt-get/dpkg (not Debian or Ubuntu); SLURM + munge not installed" in proc.stderr


def test_declining_installs_nothing_and_the_slurm_tests_say_why(tmp_path, monkeypatch):
    proc = _install_deps(tmp_path, "tests", CPT_NO_SYSTEM_PACKAGES="1")
    assert proc.returncode == 0 and "CPT_NO_SYSTEM_PACKAGES=1: nothing installed system-wide" in proc.stdout
    assert "collecting" not in proc.stdout and "apt" not in proc.stdout + proc.stderr
    monkeypatch.setattr(cluster, "_find", lambda program: None)  # as on a machine without the packages
    monkeypatch.setenv("CPT_NO_SYSTEM_PACKAGES", "1")
    assert "CPT_NO_SYSTEM_PACKAGES=1 declined installing them" in cluster.missing_requirements()
    monkeypatch.delenv("CPT_NO_SYSTEM_PACKAGES")
    assert "run scripts/install_test_deps.sh as root" in cluster.missing_requirements()


def test_the_test_command_passes_its_selection_on():
    """scripts/test.sh hands its pytest arguments (default: tests, so CI's full suite installs SLURM) to the
    package step before it runs them; the package step decides before any apt-get."""
    text = (REPO / "scripts" / "test.sh").read_text()
    assert text.index("set -- tests; fi") < text.index('bash scripts/install_test_deps.sh "$@"') < text.index("-m pytest")
    deps = SCRIPT.read_text()
    assert deps.index("CPT_NO_SYSTEM_PACKAGES") < deps.index('slurm_tests_selected "$@"') < deps.index("apt-get update")
    assert "unset PYTHON CPT_NO_SYSTEM_PACKAGES" in (REPO / ".ci" / "run").read_text()
