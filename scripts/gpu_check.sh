#!/usr/bin/env bash
# Every CUDA path against its reference, and the attention's speed, in one JSON report (see bench/gpu_check.py;
# exit 3: no CUDA device). Sections: attention, train_step, kernels, calibration, closed_loop, sharding.
#   scripts/gpu_check.sh [--out gpu_check.json] [--quick] [--only SECTIONS] [--skip SECTIONS]
#                        [--step-limit SECONDS] [--cpu-smoke]
# --quick: the attention, train_step and safety sections, each under a time cap (about 6 minutes on an H100);
# --cpu-smoke: the attention and train_step code paths on the CPU with tiny sizes (no GPU needed).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
exec "${PYTHON:-python3}" "$root/bench/gpu_check.py" "$@"
