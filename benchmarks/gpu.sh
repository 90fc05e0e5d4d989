#!/usr/bin/env bash
# The GPU rows (benchmarks/gpu.py) on the machine that is lent, with the software it has (docs/gpu.md):
#   bash benchmarks/gpu.sh                     # on a CUDA GPU: rows into $OUT (rows.jsonl, gpu.md, runs.tar.gz)
#   bash benchmarks/gpu.sh --rows probe,parity # some rows (a second call: the ones the first had no time for)
#   bash benchmarks/gpu.sh --stand-in          # no GPU: every row's CPU stand-in (the rehearsal runs this)
# It never calls pip against an index: what the python lacks comes as wheels in .whl/ (make gpu-wheels),
# installed with --no-index into a folder on PYTHONPATH (the workers inherit it).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"

# 1. The python: the project's .venv where there is one, else the machine's python3 (the one holding torch).
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
echo "python: $(command -v $PY) ($($PY --version 2>&1))"

# 2. The carried wheels (hydra-core, omegaconf, antlr4; torchao where .venv has it), never an index.
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${TMPDIR:-/tmp}/hydradist-site
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "error: installing the carried wheels (.whl/) failed; nothing ran" | tee "$OUT/gpu.log"; exit 1; }
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

# 3. What the rows import, checked before any row: one line naming what is missing and where it comes from.
MISSING=$($PY - <<'EOF'
import importlib.util
need = ["torch", "hydra", "omegaconf", "antlr4", "yaml", "tqdm", "xxhash"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$MISSING" ]; then
  echo "error: $PY lacks: $MISSING; build their wheels where pip reaches an index (make gpu-wheels) and carry .whl" \
    | tee "$OUT/gpu.log"
  exit 1
fi

# 3b. torchao (the float8 rows) is optional: the machine's or a carried wheel's; absent, those rows say so and skip.
$PY -c 'import importlib.metadata as m, importlib.util as u
print("torchao:", m.version("torchao") if u.find_spec("torchao") else "absent (the float8 rows skip; make gpu-wheels carries it)")'

# 4. torch.compile's Triton launcher is built with a C compiler against Python.h: without them the
#    compiled rows run eager, saying so.
CC_FOUND=$(command -v cc || command -v gcc || command -v clang || true)
HEADER=$($PY -c 'import os, sysconfig; p = os.path.join(sysconfig.get_paths()["include"], "Python.h"); print(p if os.path.exists(p) else "")')
NO_COMPILE=""
[ -z "$CC_FOUND" ] && NO_COMPILE="no C compiler (cc/gcc/clang) for Triton's launcher"
[ -z "$HEADER" ] && NO_COMPILE="${NO_COMPILE:+$NO_COMPILE; }no Python.h for Triton's launcher"
echo "compiler: ${CC_FOUND:-none}; Python.h: ${HEADER:-missing}"

export WANDB_MODE=offline PYTHONUNBUFFERED=1
$PY benchmarks/gpu.py --out "$OUT" ${NO_COMPILE:+--no-compile "$NO_COMPILE"} "$@" 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
