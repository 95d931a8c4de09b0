#!/usr/bin/env bash
# Every CUDA path against its reference in one JSON report (see bench/gpu_check.py; exit 3: no CUDA device).
#   scripts/gpu_check.sh [--out gpu_check.json] [--quick]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
exec "${PYTHON:-python3}" "$root/bench/gpu_check.py" "$@"
