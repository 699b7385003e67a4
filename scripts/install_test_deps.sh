#!/usr/bin/env bash
# Installs the system packages the test suite needs beyond pip: a real SLURM (slurmctld, slurmd,
# the client commands) and munge, so tests/slurm can start a two-node cluster on loopback.
#
#   bash scripts/install_test_deps.sh                 # install them (CI, or by hand)
#   bash scripts/install_test_deps.sh PYTEST_ARGS...  # only if the tests those arguments select include
#                                                     # tests marked slurm (scripts/test.sh passes its own)
#   CPT_NO_SYSTEM_PACKAGES=1                          # decline: nothing is installed system-wide; the
#                                                     # slurm tests then skip, saying why
#
# With arguments, pytest itself collects the selection (`--collect-only`, tests/selected_markers.py
# counts the tests marked slurm), so `-m "not slurm"`, `-k`, paths and node ids all count as the run
# reads them. Says what it will install, and how to decline, before it installs anything.
# Idempotent and quick when everything is already there; needs apt and root or sudo (CI runs as
# root on Debian); elsewhere it says so and installs nothing (the SLURM tests then skip).
# Package services are NOT started: the tests start their own daemons from a generated
# slurm.conf and stop exactly those, so a policy-rc.d blocks the packages' init scripts.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(slurmctld slurmd slurm-client munge)
PYTHON="${PYTHON:-python3}"  # scripts/test.sh passes its virtual environment's
# Without apt (another distribution) or without root/sudo nothing is installed: the tests marked `slurm`
# then skip themselves, saying why (tests/slurm/conftest.py), and every other test runs.
skip() {
    echo "install_test_deps: $1; SLURM + munge not installed: the tests marked slurm will be skipped" \
         "(run the rest explicitly with: -m \"not slurm\"). To run them, install slurmctld, slurmd, the" \
         "SLURM client commands and munge with your distribution's packages and run the tests as root." >&2
    exit 0
}

if [ "${CPT_NO_SYSTEM_PACKAGES:-0}" = 1 ]; then
    echo "install_test_deps: CPT_NO_SYSTEM_PACKAGES=1: nothing installed system-wide; the tests marked slurm" \
         "run only if SLURM and munge are already installed (and as root), and skip, saying why, otherwise"
    exit 0
fi

# How many of the selected tests are marked slurm (-1: pytest could not collect the selection).
slurm_tests_selected() {
    local counts status=0
    counts=$(mktemp)
    CPT_SELECTED_MARKERS="$counts" "$PYTHON" -m pytest --collect-only -q -p tests.selected_markers "$@" \
        >/dev/null 2>&1 || status=$?
    if { [ "$status" -eq 0 ] || [ "$status" -eq 5 ]; } && [ -s "$counts" ]; then  # 5: every test deselected
        "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["slurm"])' "$counts"
    else
        echo -1
    fi
    rm -f "$counts"
}

reason="the tests marked slurm need them"
if [ "$#" -gt 0 ]; then
    echo "install_test_deps: collecting the selected tests (pytest --collect-only$(printf ' %q' "$@")) to see whether" \
         "any is marked slurm"
    selected=$(slurm_tests_selected "$@")
    if [ "$selected" = 0 ]; then
        echo "install_test_deps: no selected test is marked slurm: no system packages needed, nothing installed"
        exit 0
    elif [ "$selected" = -1 ]; then
        echo "install_test_deps: pytest could not collect that selection (it will say why when it runs):" \
             "nothing installed system-wide"
        exit 0
    fi
    reason="$selected of the selected tests are marked slurm (they start a two-node SLURM cluster)"
fi

command -v dpkg-query >/dev/null && command -v apt-get >/dev/null || skip "no apt-get/dpkg (not Debian or Ubuntu)"

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "install_test_deps: ${PACKAGES[*]} already installed"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
    command -v sudo >/dev/null || skip "not root and no sudo, so ${missing[*]} cannot be installed"
else
    SUDO=
fi

echo "install_test_deps: $reason, so installing ${missing[*]} system-wide with ${SUDO:+sudo }apt-get." \
     "To decline: CPT_NO_SYSTEM_PACKAGES=1 (the slurm tests then skip) or -m \"not slurm\""
if [ -t 0 ] && [ -t 1 ]; then  # a person at a terminal gets a moment to stop it
    echo "install_test_deps: starting in 10 s (Ctrl-C to stop)"
    sleep 10
fi
export DEBIAN_FRONTEND=noninteractive
# Keep package post-install scripts from starting system daemons (exit 101 = "action forbidden").
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod +x "$policy"
    created_policy=1
fi
trap '[ "$created_policy" -eq 1 ] && $SUDO rm -f "$policy"' EXIT

$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install_test_deps: done ($(slurmctld -V 2>/dev/null || echo 'slurmctld ?'))"
