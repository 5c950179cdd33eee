#!/usr/bin/env bash
# GPU check of the KV pack/unpack kernels (kernels/, sgl_hicache_kernels) on a fresh CUDA or ROCm machine.
#
#   bash benchmarks/gpu_check.sh
#
# 1. Setup (not counted in the 3 minutes): a venv at $GPU_CHECK_VENV (default /tmp/sgl-hicache-gpu)
#    that sees the system's packages, so a preinstalled CUDA/ROCm torch is reused; torch and triton
#    are installed from pip only if missing (ROCm: set TORCH_INDEX_URL, e.g.
#    https://download.pytorch.org/whl/rocm6.4), then pytest and the kernels' distribution with
#    `pip install --no-deps -e ./kernels` (the kernels import neither sglang nor the rest of the
#    project). Offline, with torch and triton preinstalled: pytest is skipped if missing and, if the
#    install fails, kernels/ goes on PYTHONPATH (it holds the package sgl_hicache_kernels).
#    GPU_CHECK_PYTHON=/path/to/python skips all of this and uses that interpreter as it is.
# 2. Within 3 minutes: the Triton cases of tests/kernels/test_pack.py on the GPU (marker `gpu`,
#    torch.equal against the plain-torch reference), then `python -m benchmarks.kernels` for a Llama-8B-like
#    pool (32 layers, 8 KV heads, head_dim 128, bf16, 4096 tokens, page_size 1 and 64): correctness,
#    GB/s of pack/unpack vs a device-to-device copy of the same bytes, for the Triton backend and
#    for the torch backend on the same GPU. Exit status: non-zero if any of these fails. Then, in
#    the time left, a sweep of Triton launch configs (block bytes x spans per program) to pick the
#    defaults in kernels/sgl_hicache_kernels/pack_triton.py by measurement.
#
# Dry run on a CPU box (checks the script, not the kernels):
#   GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_PRESET=cpu GPU_CHECK_BACKENDS=torch \
#   GPU_CHECK_PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
unset TRITON_INTERPRET

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
  PY="$GPU_CHECK_PYTHON"
else
  VENV="${GPU_CHECK_VENV:-/tmp/sgl-hicache-gpu}"
  [[ -x "$VENV/bin/python" ]] || python3 -m venv --system-site-packages "$VENV"
  PY="$VENV/bin/python"
  if ! "$PY" -c "import torch, triton" 2>/dev/null; then
    "$PY" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch
    "$PY" -c "import triton" 2>/dev/null || "$PY" -m pip install -q triton
  fi
  "$PY" -c "import pytest" 2>/dev/null || "$PY" -m pip install -q pytest pytest-timeout ||
    echo "gpu_check: no pytest (offline?): the benchmark's torch.equal checks remain"
  "$PY" -m pip install -q --no-deps -e ./kernels || echo "gpu_check: pip install -e ./kernels failed (offline?)"
fi
# Without the install (offline, no setuptools), the package from kernels/ through PYTHONPATH.
if ! "$PY" -c "import sgl_hicache_kernels" 2>/dev/null; then
  export PYTHONPATH="$ROOT/kernels${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import sgl_hicache_kernels"
fi

if "$PY" - <<'EOF'
import torch, triton
ok = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if ok else "none"
hip = getattr(torch.version, "hip", None)
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, hip {hip}), triton {triton.__version__}, device: {name}")
raise SystemExit(0 if ok else "no CUDA/ROCm device visible to torch")
EOF
then :; elif [[ -n "${GPU_CHECK_ALLOW_CPU:-}" ]]; then echo "(dry run on CPU)"; else exit 1; fi

deadline=$((SECONDS + 180))
timed() {  # run "$@" within what is left of the 3 minutes
  local left=$((deadline - SECONDS))
  if ((left <= 0)); then echo "gpu_check: out of time before: $*" >&2; return 1; fi
  timeout "$left" "$@"
}

echo "== correctness: Triton kernels vs the torch reference (pytest -m gpu)"
if "$PY" -c "import pytest" 2>/dev/null; then
  rc=0
  timed "$PY" -m pytest -q -m gpu --noconftest -p no:cacheprovider tests/kernels/test_pack.py || rc=$?
  # exit 5 = no test selected: a failure on a GPU, where the gpu marker must select the Triton cases
  if ((rc != 0)) && ! [[ $rc == 5 && -n "${GPU_CHECK_ALLOW_CPU:-}" ]]; then exit "$rc"; fi
else
  echo "(skipped: pytest not installed)"
fi

preset="${GPU_CHECK_PRESET:-llama8b}"
for backend in ${GPU_CHECK_BACKENDS:-triton torch}; do
  echo "== bandwidth: backend=$backend, preset $preset"
  timed "$PY" -m benchmarks.kernels --preset "$preset" --page-sizes 1,64 --backend "$backend" --rounds 5
done
echo "== launch-config sweep (Triton, for choosing the defaults; informative, may run out of time)"
timed "$PY" -m benchmarks.kernels --preset "$preset" --page-sizes 1,64 --backend triton --rounds 3 --sweep ||
  echo "gpu_check: sweep incomplete (status $?)"
echo "gpu_check: done in $SECONDS s"
