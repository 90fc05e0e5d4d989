#!/usr/bin/env bash
# The first GPU call, rehearsed on this CPU machine with the lent machine's software (docs/gpu.md):
#   bash benchmarks/gpu_rehearsal.sh OUTDIR
# - a Python 3.12 environment holding what the lent machine's python3 holds that the rows touch
#   (torch 2.11.0 and its torchvision, transformers 5.17, ...) and none of this project's own
#   requirements, made once, outside .venv ($HYDRADIST_REHEARSAL_ENV; the one step that needs an index);
# - the tree that travels (tracked and untracked-not-ignored files, and the carried .whl/) copied
#   to a fresh folder, with no package index reachable and OUT=OUTDIR;
# - there, the command of docs/gpu.md with --stand-in: every row runs its CPU stand-in and writes
#   OUTDIR/rows.jsonl, gpu.md, runs.tar.gz and gpu.log. Under 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=$(realpath -m "${1:?usage: bash benchmarks/gpu_rehearsal.sh OUTDIR [gpu.py options]}")
shift
ENV=${HYDRADIST_REHEARSAL_ENV:-$HOME/.cache/gpu-rehearsal}  # not under hydradist/: clearing probe caches keeps it
LENT=(torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 safetensors tokenizers xxhash tensorboard matplotlib
      pytest pyyaml requests psutil protobuf click tqdm packaging)

if ! "$ENV/bin/python3" -c "import torch; assert torch.__version__.startswith('2.11.0')" 2>/dev/null; then
  PY312=""  # the first python3.12 that runs (a pyenv shim may name one that does not)
  for candidate in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c "" 2>/dev/null; then PY312=$candidate; break; fi
  done
  [ -n "$PY312" ] || { echo "error: the rehearsal needs a python3.12 (the lent machine's Python)"; exit 1; }
  echo "making the lent machine's environment once: $ENV (torch 2.11.0 for Python 3.12, ~5 GB)"
  "$PY312" -m venv "$ENV"
  "$ENV/bin/pip" install -q "${LENT[@]}"
fi
compgen -G ".whl/*.whl" >/dev/null || make gpu-wheels

TREE=$(mktemp -d)/tree
mkdir -p "$TREE" "$OUTDIR"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$TREE" 2>/dev/null || true
cp -r .whl "$TREE/"
echo "the tree that travels: $(du -sh "$TREE" | cut -f1) in $TREE; OUT=$OUTDIR"

cd "$TREE"
# the lent machine: its python3 first on PATH, no index (pip's every source pointed at nothing), no .venv
env -u PYTHONPATH -u VIRTUAL_ENV PATH="$ENV/bin:/usr/local/bin:/usr/bin:/bin" OUT="$OUTDIR" \
  PIP_NO_INDEX=1 PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_FIND_LINKS= PIP_CONSTRAINT= PIP_CONFIG_FILE=/dev/null \
  timeout 600 bash benchmarks/gpu.sh --stand-in "$@"
