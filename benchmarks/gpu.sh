#!/usr/bin/env bash
# The checks only a CUDA GPU can run, in one go, printing one table (see benchmarks/gpu.py):
#   bash benchmarks/gpu.sh             # on a machine with a CUDA GPU (well under 10 minutes)
#   bash benchmarks/gpu.sh --dry-run   # anywhere: composes every check and runs a CPU smoke job
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
exec "$PY" benchmarks/gpu.py "$@"
