#!/usr/bin/env bash
# The checks only a CUDA GPU can run, in one go, printing one table and writing docs/results/gpu.md
# (see benchmarks/gpu.py):
#   bash benchmarks/gpu.sh             # on a machine with a CUDA GPU (under 10 minutes)
#   bash benchmarks/gpu.sh --dry-run   # anywhere: checks the machine, says what would run and what
#                                      # would be skipped and why, composes every check, one CPU job
# GPU time is short: everything that can fail before the first GPU job is checked first.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY=1; done

# 1. The README's set-up (make's .venv), never a bare system python3 without the project's packages.
if [ ! -x .venv/bin/python ]; then
  echo "no .venv: running the README's set-up (make .venv/.installed)"
  if command -v make >/dev/null; then
    make .venv/.installed || { echo "error: the set-up failed (make .venv/.installed)"; exit 1; }
  else  # the Makefile's recipe, for a machine without make
    python3 -m venv .venv && .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1 \
      && .venv/bin/pip install -q -e ".[dev]" || { echo "error: the set-up failed (venv + pip)"; exit 1; }
  fi
fi
PY=.venv/bin/python

# 2. Driver and torch: the CUDA build of torch needs a driver at least as new as its CUDA.
DRIVER=$(nvidia-smi --query-gpu=driver_version,name --format=csv,noheader 2>/dev/null | head -1)
CUDA_OK=$($PY - <<'EOF'
import torch
print("yes" if torch.cuda.is_available() else "no", torch.__version__, torch.version.cuda or "none")
EOF
)
echo "driver: ${DRIVER:-none (nvidia-smi not found or no GPU)}; torch: ${CUDA_OK#* }"
REASONS=()
if [ "${CUDA_OK%% *}" != "yes" ]; then
  if [ -z "$DRIVER" ]; then
    REASONS+=("no NVIDIA driver or GPU visible (nvidia-smi)")
  elif [ "$(echo "$CUDA_OK" | awk '{print $3}')" = "none" ]; then
    REASONS+=("torch is a CPU-only build: reinstall the CUDA wheel (pip install torch==2.14.1)")
  else
    REASONS+=("torch built for CUDA $(echo "$CUDA_OK" | awk '{print $3}') cannot use driver ${DRIVER%%,*}: update the driver, or install a torch wheel for an older CUDA")
  fi
fi

# 3. torch.compile's Triton launcher is built with a C compiler against Python.h.
CC_FOUND=$(command -v cc || command -v gcc || command -v clang || true)
HEADER=$($PY -c 'import os, sysconfig; p = os.path.join(sysconfig.get_paths()["include"], "Python.h"); print(p if os.path.exists(p) else "")')
NO_COMPILE=""
[ -z "$CC_FOUND" ] && NO_COMPILE="no C compiler (cc/gcc/clang): Triton cannot build its launcher; apt-get install gcc"
[ -z "$HEADER" ] && NO_COMPILE="${NO_COMPILE:+$NO_COMPILE; }no Python.h: apt-get install python3-dev (or python3.X-dev)"
echo "compiler: ${CC_FOUND:-none}; Python.h: ${HEADER:-missing}"

if [ $DRY = 1 ] && [ ${#REASONS[@]} -gt 0 ]; then
  printf 'here the GPU rows would not run: %s\n' "${REASONS[@]}"
fi
if [ $DRY = 0 ] && [ ${#REASONS[@]} -gt 0 ]; then
  printf 'error: %s\n' "${REASONS[@]}"
  echo "nothing ran; bash benchmarks/gpu.sh --dry-run checks everything else on a machine without a GPU"
  exit 1
fi
exec "$PY" benchmarks/gpu.py "$@" ${NO_COMPILE:+--no-compile "$NO_COMPILE"}
