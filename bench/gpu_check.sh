#!/usr/bin/env bash
# Run from the repo root on a lent GPU host (torch + CUDA, pydantic and crc32c; no Ray needed):
#   OUT=/some/dir bash bench/gpu_check.sh            # figures in $OUT/gpu_check.{log,json}
#   bash bench/gpu_check.sh --device cpu             # the same checks on CPU (dry run)
#   bash bench/gpu_check.sh --bench NAME [ARGS...]   # one bench module alone (bench/NAME.py)
# About 6-8 minutes on one H200 ($GPU_CHECK_BUDGET_S, default 420 s, skips what is left; the
# whole run is cut at $GPU_CHECK_TIMEOUT_S, default 540 s). Exit code 0 only when every check
# passed.
set -uo pipefail
OUT="${OUT:-$(pwd)/gpu_check_out}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: the checks may run from elsewhere
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
PY="$(command -v python3 || command -v python)"
{
  echo "== gpu_check $(date -u +%FT%TZ) host $(hostname)"
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  df -h /dev/shm /tmp 2>/dev/null; free -g 2>/dev/null | head -2
} 2>&1 | tee -a "$OUT/gpu_check.log"
# The checks import `tenax`, whose sub-packages only an install maps onto the role folders
# (setup.py). A lent host without one gets the same layout as links in a temporary tree
# (tenax/ plus the role folders under it, and bench/), and the checks run from there.
if ! "$PY" -c 'import tenax.workers' 2>/dev/null; then
  REPO="$(pwd)" TREE="$(mktemp -d)"
  mkdir "$TREE/tenax"
  ln -s "$REPO"/tenax/* "$TREE/tenax/"
  for role in orchestrator workers checkpoint parallel; do
    ln -s "$REPO/$role" "$TREE/tenax/$role"
  done
  ln -s "$REPO/proto/tenax/v1" "$TREE/tenax/v1"
  ln -s "$REPO/bench" "$TREE/bench"
  cd "$TREE" && export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
  echo "== tenax is not installed: running from $TREE (links into $REPO)" \
    | tee -a "$OUT/gpu_check.log"
fi
if [ "${1:-}" = "--bench" ]; then
  exec timeout "${GPU_CHECK_TIMEOUT_S:-540}" "$PY" -m "bench.$2" "${@:3}"
fi
exec timeout "${GPU_CHECK_TIMEOUT_S:-540}" "$PY" -m bench.gpu_check --out "$OUT" "$@"
