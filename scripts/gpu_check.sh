#!/usr/bin/env bash
# GPU check: bit-exactness across cache modes and the cache benchmark on CUDA, from the source
# tree with only torch, numpy, safetensors, tokenizers, jinja2, tqdm and gguf. Under 5 minutes on one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# Deterministic cuBLAS workspaces, so that equal inputs give equal bits run to run.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec python3 scripts/gpu_check.py "$@"
