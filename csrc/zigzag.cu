// zigzag_pack / zigzag_unpack: one rank's (or several ranks') zigzag shards of whole THD samples, with the
// shard-row -> sample-row map computed in the kernel from cu_seqlens, so no index tensor is built.
#include "copy_rows.cuh"
#include "dhp_kernels.h"

namespace dhp {
namespace {

// Shard row -> row of the whole-sample tensor, or -1 for padding.
struct ZigzagMap {
  ZigzagLayout z;

  __device__ int64_t operator()(int64_t row) const {
    const int64_t rank = z.first_rank + row / z.rows_per_rank;
    const int64_t j = row % z.rows_per_rank;
    // last sample s with local_cu[s] <= j; it is non-empty because local_cu[s + 1] > j
    int64_t lo = 0, hi = z.num_samples;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (z.local_cu[mid] <= j) lo = mid; else hi = mid;
    }
    const int64_t offset = j - z.local_cu[lo];
    int64_t pos = offset;
    if (z.group_size > 1) {
      const int64_t chunk = (z.local_cu[lo + 1] - z.local_cu[lo]) / 2;
      pos = offset < chunk ? rank * chunk + offset : (2 * z.group_size - 1 - rank) * chunk + offset - chunk;
    }
    return pos < z.cu[lo + 1] - z.cu[lo] ? z.cu[lo] + pos : -1;
  }
};

}  // namespace

const char* zigzag_pack(const void* x, void* out, const void* pad_row, ZigzagLayout layout, int64_t row_bytes,
                        void* stream) {
  return launch_gather(x, out, pad_row, ZigzagMap{layout}, layout.num_ranks * layout.rows_per_rank, row_bytes, stream);
}

const char* zigzag_unpack(const void* shard, void* out, ZigzagLayout layout, int64_t row_bytes, void* stream) {
  return launch_scatter(shard, out, ZigzagMap{layout}, layout.num_ranks * layout.rows_per_rank, row_bytes, stream);
}

}  // namespace dhp
