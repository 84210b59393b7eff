#!/usr/bin/env bash
# One-shot GPU check (docs/gpu.md): about 7-8 minutes on one H100 (estimated); each row printed, and appended to
# <report>/gpu_check.md, as it finishes; one summary table at the end.
#   timeout -k 15 540 bash scripts/gpu_check.sh --report "$OUT"   # the lent machine's one call: every finished
#                                           # row is on disk in $OUT even if the timeout stops it
#   bash scripts/gpu_check.sh              # needs a CUDA device; report in results/gpu/
#   bash scripts/gpu_check.sh --dry-run    # CPU, tiny model, few steps: the same stages, for CI
# The interpreter is $PYTHON, else python3 (on the GPU machine: the venv's python3, which has torch).
# Exit code: 0 when no row FAILs, 1 when one does, 2 without a CUDA device (and no --dry-run), 128 + the signal
# after SIGTERM / SIGINT (the finished rows are reported).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # deterministic cuBLAS for the resume stage
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
