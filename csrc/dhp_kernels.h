// Launchers of megatron-dhp's CUDA kernels: plain C++ over raw pointers, so that the torch binding
// (binding.cpp) needs neither CUDA headers nor ATen's CUDA API, and the kernels need no torch headers.
//
// Every launcher enqueues its work on `stream` (a cudaStream_t passed as void*) and returns nullptr on
// success or the CUDA error message of the launch. Tensors are contiguous; a "row" is one index of dim 0.
#pragma once

#include <cstdint>

namespace dhp {

// out[i] = x[index[i]] for i < num_out_rows; index values must lie in [0, num_in_rows) (device-checked).
// Duplicates are allowed.
const char* gather_rows(const void* x, void* out, const int64_t* index, int64_t num_in_rows,
                        int64_t num_out_rows, int64_t row_bytes, void* stream);

// out[index[i]] = x[i] for i < num_in_rows; rows of `out` that no index names are left untouched.
// Contract: index values are distinct (each output row is written at most once, so no atomics and no
// races) and lie in [0, num_out_rows) (device-checked). Duplicates are not detected: the result is then
// undefined.
const char* scatter_rows(const void* x, void* out, const int64_t* index, int64_t num_in_rows,
                         int64_t num_out_rows, int64_t row_bytes, void* stream);

// The zigzag layout of whole samples on a group of `group_size` ranks. Sample s occupies rows
// [cu[s], cu[s+1]) of the whole-sample tensor and rows [local_cu[s], local_cu[s+1]) of every rank's
// shard; local_cu[num_samples] == rows_per_rank. For group_size 1 a shard is the sample itself;
// otherwise the shard holds chunk r then chunk 2d-1-r of the sample padded to 2d chunks of
// (local_cu[s+1] - local_cu[s]) / 2 rows each. Ranks first_rank .. first_rank+num_ranks-1 are laid out
// one after another (rank-major), num_ranks * rows_per_rank rows in all.
struct ZigzagLayout {
  const int64_t* cu;
  const int64_t* local_cu;
  int64_t num_samples;
  int64_t group_size;
  int64_t first_rank;
  int64_t num_ranks;
  int64_t rows_per_rank;
};

// Shard rows from whole samples `x` (cu[num_samples] rows); padding rows are copies of `pad_row`.
const char* zigzag_pack(const void* x, void* out, const void* pad_row, ZigzagLayout layout,
                        int64_t row_bytes, void* stream);

// The inverse: every real (non-padding) shard row goes back to its place in `out` (cu[num_samples]
// rows); padding rows are ignored and rows the given ranks do not hold are left untouched.
const char* zigzag_unpack(const void* shard, void* out, ZigzagLayout layout, int64_t row_bytes,
                          void* stream);

enum class Float { kFloat32, kFloat16, kBFloat16 };

// Merge k partial attention outputs over disjoint key blocks: outs [k, rows, dim] (rows = tokens x
// heads) with their log-sum-exps lses [k, rows] (fp32) -> out [rows, dim]; fp32 accumulation.
const char* lse_merge(const void* outs, const float* lses, void* out, int64_t k, int64_t rows,
                      int64_t dim, Float dtype, void* stream);

// Its backward: grad [rows, dim] -> grad_outs [k, rows, dim] and grad_lses [k, rows] (fp32).
const char* lse_merge_backward(const void* outs, const float* lses, const void* grad, void* grad_outs,
                               float* grad_lses, int64_t k, int64_t rows, int64_t dim, Float dtype,
                               void* stream);

}  // namespace dhp
