#!/usr/bin/env bash
# One-shot GPU check (docs/gpu.md): about 5 minutes on one GPU, one summary table at the end.
#   bash scripts/gpu_check.sh              # needs a CUDA device
#   bash scripts/gpu_check.sh --dry-run    # CPU, tiny model, few steps: the same stages, for CI
# Exit code: 0 when no row FAILs, 1 when one does, 2 without a CUDA device (and no --dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # deterministic cuBLAS for the resume stage
exec python scripts/gpu_check.py "$@"
