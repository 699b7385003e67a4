#!/usr/bin/env bash
# Installs the system packages the test suite needs beyond pip: a real SLURM (slurmctld, slurmd,
# the client commands) and munge, so tests/slurm can start a two-node cluster on loopback.
# Idempotent and quick when everything is already there; needs apt and root or sudo (CI runs as
# root on Debian); elsewhere it says so and installs nothing (the SLURM tests then skip).
# Package services are NOT started: the tests start their own daemons from a generated
# slurm.conf and stop exactly those, so a policy-rc.d blocks the packages' init scripts.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
# Without apt (another distribution) or without root/sudo nothing is installed: the tests marked `slurm`
# then skip themselves, saying why (tests/slurm/conftest.py), and every other test runs.
skip() {
    echo "install_test_deps: $1; SLURM + munge not installed: the tests marked slurm will be skipped" \
         "(run the rest explicitly with: -m \"not slurm\"). To run them, install slurmctld, slurmd, the" \
         "SLURM client commands and munge with your distribution's packages and run the tests as root." >&2
    exit 0
}
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

echo "install_test_deps: installing ${missing[*]}"
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
