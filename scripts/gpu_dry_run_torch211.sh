#!/usr/bin/env bash
# The GPU check's dry run on the GPU machine's torch: 2.11.0 (its image: Python 3.12, torch 2.11.0+cu130, numpy,
# tiktoken, tqdm, tensorboard, safetensors, matplotlib, pytest, transformers; no package registry there), so a
# change that needs a newer torch fails here, on a CPU, before it meets the GPU (docs/gpu.md).
#   bash scripts/gpu_dry_run_torch211.sh            # venv in $TORCH211_VENV (default ~/.cache/venv-torch211)
#   TORCH211_VENV=/work/venv-torch211 BASE_PYTHON=python3.12 bash scripts/gpu_dry_run_torch211.sh
# The first run creates the venv (PyPI's torch==2.11.0 with its CUDA dependency packages: about 3 GB, which
# import on a CPU machine) and installs what the dry run imports that the image has; later runs reuse it.
# Exit code: the dry run's (0: no row FAILs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TORCH211_VENV:-$HOME/.cache/venv-torch211}"
case "$VENV" in
  "$PWD"|"$PWD"/*) echo "gpu_dry_run_torch211: error: TORCH211_VENV=$VENV is inside the repository; put it outside" >&2
                   exit 2 ;;
esac
has_torch211() { "$VENV/bin/python3" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.11.0")'; }
if [ ! -x "$VENV/bin/python3" ] || ! has_torch211 2>/dev/null; then
  BASE="${BASE_PYTHON:-$(command -v python3.12 || command -v python3)}"
  echo "gpu_dry_run_torch211: creating $VENV with $("$BASE" --version) (the GPU machine's is Python 3.12)"
  "$BASE" -m venv "$VENV"
  # PIP_CONSTRAINT / PIP_FIND_LINKS of this machine may point at a newer local torch: ask for exactly 2.11.0
  "$VENV/bin/python3" -m pip install --quiet "torch==2.11.0" numpy tiktoken tqdm pytest
fi
"$VENV/bin/python3" -c 'import torch; print(f"gpu_dry_run_torch211: torch {torch.__version__} in '"$VENV"'")'
PYTHON="$VENV/bin/python3" exec bash scripts/gpu_check.sh --dry-run "$@"
