#!/usr/bin/env bash
# Run from the repo root on a lent GPU host (torch + CUDA; no Ray/pydantic needed):
#   OUT=/some/dir bash bench/gpu_check.sh            # figures in $OUT/gpu_check.{log,json}
#   bash bench/gpu_check.sh --device cpu             # the same checks on CPU (dry run)
# About 3-6 minutes on one H200. Exit code 0 only when every check passed.
set -uo pipefail
OUT="${OUT:-$(pwd)/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
PY="$(command -v python3 || command -v python)"
{
  echo "== gpu_check $(date -u +%FT%TZ) host $(hostname)"
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
} 2>&1 | tee -a "$OUT/gpu_check.log"
exec timeout 480 "$PY" bench/gpu_check.py --out "$OUT" "$@"
