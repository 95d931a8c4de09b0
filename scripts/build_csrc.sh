#!/usr/bin/env bash
# Compile csrc/ ahead of time into one library of torch operators (torch.ops.megatron_dhp.*):
# every .cu with nvcc for each arch in $DHP_CUDA_ARCHS (default "80 90"), the binding with $CXX, then a link.
# The flags are those of torch's JIT build. It needs no GPU and works against a CPU-only torch (the binding
# uses no CUDA headers), which is how CI proves the kernels compile. On a GPU machine, point
# MEGATRON_DHP_CSRC at the library to use it instead of the JIT build.
#
#   scripts/build_csrc.sh [OUT_DIR]      (default build/csrc; prints the library path)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$root/build/csrc}" && cd "${1:-$root/build/csrc}" && pwd)
nvcc=${NVCC:-nvcc}
if [[ -z "${CUDA_HOME:-}" && -d /usr/local/cuda ]]; then CUDA_HOME=/usr/local/cuda; fi
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v "$nvcc")")")")}

# torch's include dirs, library dir, C++ ABI and nvcc defines, as shell words
eval "$(python - <<'PY'
import shlex, torch, torch.utils.cpp_extension as ext
from pathlib import Path
print("torch_includes=(" + " ".join(shlex.quote(p) for p in ext.include_paths()) + ")")
print("torch_lib=" + shlex.quote(str(Path(torch.__file__).parent / "lib")))
print("abi=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))
print("nvcc_defines=(" + " ".join(shlex.quote(f) for f in ext.COMMON_NVCC_FLAGS) + ")")
PY
)"

includes=()
for dir in "${torch_includes[@]}"; do includes+=(-isystem "$dir"); done
gencode=()
for arch in ${DHP_CUDA_ARCHS:-80 90}; do gencode+=(-gencode "arch=compute_$arch,code=sm_$arch"); done

pids=()
for src in "$root"/csrc/*.cu; do
  "$nvcc" -c -O3 -std=c++20 "${nvcc_defines[@]}" --compiler-options -fPIC "${gencode[@]}" \
    "$src" -o "$out/$(basename "$src" .cu).cu.o" &
  pids+=($!)
done
"${CXX:-g++}" -c -O3 -std=c++20 -fPIC -Wall -D_GLIBCXX_USE_CXX11_ABI="$abi" "${includes[@]}" \
  "$root/csrc/binding.cpp" -o "$out/binding.o" &
pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done

"${CXX:-g++}" -shared "$out"/*.o -L"$torch_lib" -lc10 -ltorch_cpu -L"$cuda_home/lib64" -lcudart \
  -Wl,-rpath,"$cuda_home/lib64" -o "$out/libmegatron_dhp_csrc.so"
echo "$out/libmegatron_dhp_csrc.so"
