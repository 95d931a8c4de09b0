#!/usr/bin/env bash
# The tests that compare floating-point results (exactness against one process, oracles, encoders) under each
# CPU kernel set torch can pick (ATEN_CPU_CAPABILITY) and each thread count (OMP_NUM_THREADS): one line per
# combination, pass or FAIL; exit 1 if any failed. See docs/contributing.md.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/numerics_check.sh [--caps "default avx2 avx512"] [--threads "1 2"] [--quick] [-- PYTEST_ARGS...]

Runs the numerics-sensitive tests once per (ATEN_CPU_CAPABILITY, OMP_NUM_THREADS) combination and prints one
line per combination. A kernel set this CPU lacks is skipped (said on its line). Defaults come from
NUMERICS_CAPS and NUMERICS_THREADS when set.

  --caps LIST      kernel sets to run (default: "default avx2 avx512")
  --threads LIST   thread counts to run (default: "1 2")
  --quick          only the quick tier of those tests (-m "not slow": kernels and math, no spawned ranks)
  -- ARGS          passed to pytest (e.g. -- -k vlm)
  -h, --help       this text

The whole set takes 15-20 minutes per combination on 2 shared cores; --quick under a minute.
EOF
}

caps=${NUMERICS_CAPS:-"default avx2 avx512"}
threads=${NUMERICS_THREADS:-"1 2"}
marks=()
while (($#)); do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --caps) caps=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --quick) marks=(-m "not slow"); shift ;;
        --) shift; break ;;
        *) echo "numerics_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

tests=(
    tests/runtime/test_attention_math.py       # block attention and the log-sum-exp merge against dense math
    tests/runtime/test_attention_kernels.py    # every CPU kernel and comm variant against the fp64 oracle
    tests/kernels/test_fused.py                # the fused kernels' CPU paths, bit for bit and in fp64
    tests/runtime/test_rope.py                 # RoPE by position against megatron's, bit for bit
    tests/runtime/test_ring_attention.py       # ring attention on gloo ranks against one process
    tests/runtime/test_vlm.py                  # the vision-language model and its encoder
    tests/test_encoder.py                      # the encoder's cost terms
    tests/runtime/test_distributed.py          # loss and every gradient against one process
    tests/runtime/test_uneven_shards.py
    tests/runtime/test_moe.py
    tests/runtime/test_pipeline_runtime.py
    tests/megatron/test_hooks_distributed.py   # the Megatron-LM hooks against one process
)

# The CPU flags ATen asks for before it uses a kernel set (a set the CPU lacks would die of SIGILL).
supported() {
    local flags
    flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
    case $1 in
        default) return 0 ;;
        avx2) [[ $flags == *" avx2"* && $flags == *" fma"* ]] ;;
        avx512) [[ $flags == *" avx512f"* && $flags == *" avx512bw"* && $flags == *" avx512vl"* && $flags == *" avx512dq"* ]] ;;
        *) return 1 ;;
    esac
}

cd "$(dirname "$0")/.."
# Several ranks of 2 OpenMP threads on few cores: waiting threads that spin slow small ops many-fold; passive
# waiting leaves every result as it is.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
logs=$(mktemp -d)
failed=0
for cap in $caps; do
    for n in $threads; do
        name="ATEN_CPU_CAPABILITY=$cap OMP_NUM_THREADS=$n"
        if ! supported "$cap"; then
            echo "$name: skip (this CPU has no $cap kernels)"
            continue
        fi
        log="$logs/$cap-$n.log"
        if ATEN_CPU_CAPABILITY=$cap OMP_NUM_THREADS=$n "${PYTHON:-python3}" -m pytest -q "${marks[@]}" "${tests[@]}" "$@" \
                >"$log" 2>&1; then
            echo "$name: pass ($(tail -n 1 "$log"))"
        else
            echo "$name: FAIL ($(tail -n 1 "$log"); log: $log)"
            grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /' || true
            failed=1
        fi
    done
done
exit $failed
