// lse_merge: combine partial attention outputs over disjoint key blocks by their log-sum-exps, and its
// backward. One warp per (token, head) row; weights w_j = exp(lse_j - logsumexp_j lse_j) in fp32, outputs
// accumulated in fp32 and rounded once to the output dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "copy_rows.cuh"
#include "dhp_kernels.h"

namespace dhp {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int kPerLane = 4;  // elements of a row each lane accumulates per pass: dim <= 128 takes one pass

__device__ float to_float(float x) { return x; }
__device__ float to_float(__half x) { return __half2float(x); }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ T from_float(float x);
template <>
__device__ float from_float<float>(float x) { return x; }
template <>
__device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ float warp_sum(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// A partial whose row saw no key (-inf from a masked softmax, +inf from flash attention's empty key range) as
// the finite stand-in the torch path uses (attention/math.py: MASKED, `finite_lse`): it then weighs 0.
__device__ float usable(float lse) { return isfinite(lse) ? lse : -1.0e30f; }

// logsumexp over the k partials of `row` (every lane computes it; k is the group size, small).
__device__ float total_lse(const float* lses, int64_t k, int64_t rows, int64_t row) {
  float m = -INFINITY;
  for (int64_t j = 0; j < k; ++j) m = fmaxf(m, usable(lses[j * rows + row]));
  float s = 0.f;
  for (int64_t j = 0; j < k; ++j) s += expf(usable(lses[j * rows + row]) - m);
  return m + logf(s);
}

template <typename T>
__global__ void merge_kernel(const T* __restrict__ outs, const float* __restrict__ lses, T* __restrict__ out, int64_t k,
                             int64_t rows, int64_t dim) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; row < rows;
       row += int64_t(gridDim.x) * kWarpsPerBlock) {
    const float total = total_lse(lses, k, rows, row);
    for (int64_t base = 0; base < dim; base += kWarp * kPerLane) {
      float acc[kPerLane] = {};
      for (int64_t j = 0; j < k; ++j) {
        const float w = expf(usable(lses[j * rows + row]) - total);
        const T* part = outs + (j * rows + row) * dim;
        for (int v = 0; v < kPerLane; ++v) {
          const int64_t i = base + v * kWarp + lane;
          if (i < dim) acc[v] += w * to_float(part[i]);
        }
      }
      for (int v = 0; v < kPerLane; ++v) {
        const int64_t i = base + v * kWarp + lane;
        if (i < dim) out[row * dim + i] = from_float<T>(acc[v]);
      }
    }
  }
}

// d out / d outs_j = w_j; d out / d lse_j = w_j (outs_j - out), so with D_j = <grad, outs_j>:
// grad_lse_j = w_j (D_j - sum_i w_i D_i). D_j is parked in grad_lses until the sum is known.
template <typename T>
__global__ void merge_backward_kernel(const T* __restrict__ outs, const float* __restrict__ lses,
                                      const T* __restrict__ grad, T* __restrict__ grad_outs, float* grad_lses,
                                      int64_t k, int64_t rows, int64_t dim) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; row < rows;
       row += int64_t(gridDim.x) * kWarpsPerBlock) {
    const float total = total_lse(lses, k, rows, row);
    const T* g = grad + row * dim;
    float weighted = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const float w = expf(usable(lses[j * rows + row]) - total);
      const T* part = outs + (j * rows + row) * dim;
      T* grad_part = grad_outs + (j * rows + row) * dim;
      float dot = 0.f;
      for (int64_t i = lane; i < dim; i += kWarp) {
        const float gi = to_float(g[i]);
        dot += gi * to_float(part[i]);
        grad_part[i] = from_float<T>(w * gi);
      }
      dot = warp_sum(dot);
      weighted += w * dot;
      if (lane == 0) grad_lses[j * rows + row] = dot;
    }
    __syncwarp();
    for (int64_t j = lane; j < k; j += kWarp) {
      const float w = expf(usable(lses[j * rows + row]) - total);
      grad_lses[j * rows + row] = w * (grad_lses[j * rows + row] - weighted);
    }
    __syncwarp();
  }
}

template <typename Launch>
const char* with_dtype(Float dtype, Launch&& launch) {
  switch (dtype) {
    case Float::kFloat32: launch(float{}); break;
    case Float::kFloat16: launch(__half{}); break;
    case Float::kBFloat16: launch(__nv_bfloat16{}); break;
  }
  return launch_status();
}

}  // namespace

const char* lse_merge(const void* outs, const float* lses, void* out, int64_t k, int64_t rows, int64_t dim,
                      Float dtype, void* stream) {
  if (rows == 0 || dim == 0) return nullptr;
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    merge_kernel<T><<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, cudaStream_t(stream)>>>(
        static_cast<const T*>(outs), lses, static_cast<T*>(out), k, rows, dim);
  });
}

const char* lse_merge_backward(const void* outs, const float* lses, const void* grad, void* grad_outs,
                               float* grad_lses, int64_t k, int64_t rows, int64_t dim, Float dtype, void* stream) {
  if (rows == 0) return nullptr;
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    merge_backward_kernel<T><<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, cudaStream_t(stream)>>>(
        static_cast<const T*>(outs), lses, static_cast<const T*>(grad), static_cast<T*>(grad_outs), grad_lses, k, rows,
        dim);
  });
}

}  // namespace dhp
