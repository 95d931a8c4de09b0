// Row-copy kernels shared by gather/scatter and zigzag pack/unpack: one thread per 1-16 byte vector of a
// row, a grid-stride loop over all of them, and a `Map` functor that says which row goes where.
// Copies are bit-exact for any dtype, so the kernels never look at element types.
#pragma once

#include <cuda_runtime.h>

#include <cassert>
#include <cstdint>

#ifdef NDEBUG
// glibc declares __assert_fail only without NDEBUG; declare it as glibc does (torch's Macros.h does the same),
// host and device in the device pass, where CUDA provides it.
extern "C" {
#ifdef __CUDA_ARCH__
__host__ __device__
#endif
    void
    __assert_fail(const char* assertion, const char* file, unsigned int line, const char* function) noexcept
    __attribute__((__noreturn__));
}
#endif

namespace dhp {

// Device-side bounds check that survives NDEBUG (the same mechanism as torch's CUDA_KERNEL_ASSERT).
#define DHP_KERNEL_ASSERT(cond)                                                        \
  if (!(cond)) {                                                                       \
    __assert_fail(#cond, __FILE__, static_cast<unsigned int>(__LINE__), __func__);   \
  }

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

inline const char* launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

inline unsigned blocks_for(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// dst[row] = src[map(row)], or `pad` where map(row) < 0.
template <typename Vec, typename Map>
__global__ void gather_kernel(const Vec* __restrict__ src, Vec* __restrict__ dst, const Vec* __restrict__ pad,
                              Map map, int64_t num_rows, int64_t row_vecs) {
  const int64_t total = num_rows * row_vecs;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / row_vecs;
    const int64_t col = e - row * row_vecs;
    const int64_t from = map(row);
    dst[e] = from >= 0 ? src[from * row_vecs + col] : pad[col];
  }
}

// dst[map(row)] = src[row], skipping rows where map(row) < 0. Each destination row is written once by
// contract, so plain stores suffice.
template <typename Vec, typename Map>
__global__ void scatter_kernel(const Vec* __restrict__ src, Vec* __restrict__ dst, Map map, int64_t num_rows,
                               int64_t row_vecs) {
  const int64_t total = num_rows * row_vecs;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / row_vecs;
    const int64_t to = map(row);
    if (to >= 0) dst[to * row_vecs + (e - row * row_vecs)] = src[e];
  }
}

// Widest of 16/8/4/2/1 bytes that divides the row and every pointer's alignment.
inline int vector_bytes(int64_t row_bytes, const void* a, const void* b, const void* c) {
  uintptr_t bits = static_cast<uintptr_t>(row_bytes) | reinterpret_cast<uintptr_t>(a) |
                   reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(c) | 16;
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

// Calls launch(Vec{}) with the vector type of `vector_bytes`.
template <typename Launch>
void with_vector(int bytes, Launch&& launch) {
  switch (bytes) {
    case 16: launch(uint4{}); break;
    case 8: launch(uint2{}); break;
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    default: launch(uint8_t{}); break;
  }
}

// `num_rows` rows of `row_bytes` from src into dst through `map`; `pad` may be null when map never
// returns a negative row.
template <typename Map>
const char* launch_gather(const void* src, void* dst, const void* pad, Map map, int64_t num_rows, int64_t row_bytes,
                          void* stream) {
  if (num_rows == 0 || row_bytes == 0) return nullptr;
  with_vector(vector_bytes(row_bytes, src, dst, pad), [&](auto tag) {
    using Vec = decltype(tag);
    const int64_t row_vecs = row_bytes / int64_t(sizeof(Vec));
    gather_kernel<Vec, Map><<<blocks_for(num_rows * row_vecs, kThreads), kThreads, 0, cudaStream_t(stream)>>>(
        static_cast<const Vec*>(src), static_cast<Vec*>(dst), static_cast<const Vec*>(pad), map, num_rows, row_vecs);
  });
  return launch_status();
}

template <typename Map>
const char* launch_scatter(const void* src, void* dst, Map map, int64_t num_rows, int64_t row_bytes, void* stream) {
  if (num_rows == 0 || row_bytes == 0) return nullptr;
  with_vector(vector_bytes(row_bytes, src, dst, nullptr), [&](auto tag) {
    using Vec = decltype(tag);
    const int64_t row_vecs = row_bytes / int64_t(sizeof(Vec));
    scatter_kernel<Vec, Map><<<blocks_for(num_rows * row_vecs, kThreads), kThreads, 0, cudaStream_t(stream)>>>(
        static_cast<const Vec*>(src), static_cast<Vec*>(dst), map, num_rows, row_vecs);
  });
  return launch_status();
}

}  // namespace dhp
