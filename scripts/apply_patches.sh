#!/usr/bin/env bash
# Add megatron-dhp's hooks to a Megatron-LM checkout (core_v0.16.1 through main and dev); safe to run twice.
#   scripts/apply_patches.sh /path/to/Megatron-LM            # apply
#   scripts/apply_patches.sh /path/to/Megatron-LM --check    # only report
#   scripts/apply_patches.sh /path/to/Megatron-LM --revert   # remove again
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 MEGATRON_LM_PATH [--check] [--revert]" >&2
  exit 2
fi
# Works from a source checkout of megatron-dhp as well as from an installed one.
DHP_ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHONPATH="$DHP_ROOT${PYTHONPATH:+:$PYTHONPATH}" exec python -m megatron_dhp apply-patches --megatron-lm "$1" "${@:2}"
