// gather_rows / scatter_rows by an int64 row index: the re-dispatch primitive (see dhp_kernels.h).
#include "copy_rows.cuh"
#include "dhp_kernels.h"

namespace dhp {
namespace {

struct IndexMap {
  const int64_t* index;
  int64_t limit;  // rows of the indexed tensor

  __device__ int64_t operator()(int64_t row) const {
    const int64_t i = index[row];
    DHP_KERNEL_ASSERT(0 <= i && i < limit);
    return i;
  }
};

}  // namespace

const char* gather_rows(const void* x, void* out, const int64_t* index, int64_t num_in_rows, int64_t num_out_rows,
                        int64_t row_bytes, void* stream) {
  return launch_gather(x, out, nullptr, IndexMap{index, num_in_rows}, num_out_rows, row_bytes, stream);
}

const char* scatter_rows(const void* x, void* out, const int64_t* index, int64_t num_in_rows, int64_t num_out_rows,
                         int64_t row_bytes, void* stream) {
  return launch_scatter(x, out, IndexMap{index, num_out_rows}, num_in_rows, row_bytes, stream);
}

}  // namespace dhp
