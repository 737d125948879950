#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian machine: the package with its test
# extras (torch CPU 2.13.0, Fabric, submitit, scikit-learn, Lightning, accelerate, wandb, pytest,
# ruff, mypy) and the system tools the tests call (shellcheck, pdsh, sshd, Slurm and munge, iproute2;
# Chromium to render the HTML report headless, tmux to drive the live view in a terminal,
# podman to run jobs in containers).
# Idempotent.
# The Slurm and SSH test clusters install their own packages too when started by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet 'torch==2.13.0' -e '.[test]'

need=()
command -v shellcheck >/dev/null || need+=(shellcheck)
command -v pdsh >/dev/null || need+=(pdsh)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null || need+=(openssh-client)
command -v ip >/dev/null || need+=(iproute2)
command -v slurmctld >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || need+=(chromium fonts-dejavu-core)
command -v tmux >/dev/null || need+=(tmux)
# podman (and runc) run the container tests' image, built locally: tests/support/containers.py
command -v podman >/dev/null || need+=(podman runc)
# debootstrap builds the second Slurm release's root (Debian 13, Slurm 24.11) below
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "tests/setup.sh: please install (as root): ${need[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The second Slurm release (tests/clusters/slurm-root.sh): its root takes minutes to build, so
# it is built in the background, once (cached at ORCHESTRATE_SLURM_ROOT), while the suite's
# first tests run; the 24.11 tests wait for it, and skip with the reason if it fails.
# ORCHESTRATE_SLURM_ROOT_BUILD=0 leaves it out.
if [ "$(id -u)" -eq 0 ] && [ "${ORCHESTRATE_SLURM_ROOT_BUILD:-1}" != 0 ]; then
  root=${ORCHESTRATE_SLURM_ROOT:-/var/cache/orchestrate/slurm-trixie}
  mkdir -p "$(dirname "$root")"
  setsid -f bash tests/clusters/slurm-root.sh root </dev/null >>"$root.build.out" 2>&1
fi
echo "tests/setup.sh: ready"
