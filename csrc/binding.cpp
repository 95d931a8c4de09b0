// The launchers of dhp_kernels.h as torch operators `torch.ops.megatron_dhp.*`, registered for CUDA tensors
// only (megatron_dhp/runtime/fused.py is the one caller; a CPU tensor gets the dispatcher's "could not run
// with arguments from the CPU backend" error).
//
// Shape checks, output allocation and the current stream live here; the kernels see raw pointers. The
// stream and device guard come from c10's device-generic interface and only a few ATen operator headers
// are included, so this file needs no CUDA headers, compiles in seconds, and links against any torch
// build, CPU-only included.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "dhp_kernels.h"

namespace {

void check_launch(const char* error) { TORCH_CHECK(error == nullptr, "megatron_dhp CUDA kernel failed: ", error); }

void* current_stream(const at::Tensor& t) {
  return c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device()).native_handle();
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

void check_index(const at::Tensor& index, const at::Tensor& x) {
  check_cuda(index, "index");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1, "index must be a 1-D int64 tensor");
  TORCH_CHECK(index.device() == x.device(), "index is on ", index.device(), " but the rows on ", x.device());
}

// [rows, *rest] with the rest of `x`'s shape.
std::vector<int64_t> rows_like(const at::Tensor& x, int64_t rows) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] = rows;
  return shape;
}

int64_t row_bytes(const at::Tensor& x) {
  int64_t n = x.element_size();
  for (int64_t d = 1; d < x.dim(); ++d) n *= x.size(d);
  return n;
}

at::Tensor gather_rows(const at::Tensor& x_in, const at::Tensor& index) {
  check_cuda(x_in, "x");
  TORCH_CHECK(x_in.dim() >= 1, "x must have a row dimension");
  check_index(index, x_in);
  const c10::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), idx = index.contiguous();
  at::Tensor out = at::empty(rows_like(x, idx.numel()), x.options());
  check_launch(dhp::gather_rows(x.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>(), x.size(0), idx.numel(),
                                row_bytes(x), current_stream(x)));
  return out;
}

at::Tensor scatter_rows(const at::Tensor& x_in, const at::Tensor& index, int64_t num_rows) {
  check_cuda(x_in, "x");
  TORCH_CHECK(x_in.dim() >= 1, "x must have a row dimension");
  check_index(index, x_in);
  TORCH_CHECK(index.numel() == x_in.size(0), "index has ", index.numel(), " entries for ", x_in.size(0), " rows");
  TORCH_CHECK(num_rows >= 0, "num_rows must be >= 0");
  const c10::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), idx = index.contiguous();
  at::Tensor out = at::zeros(rows_like(x, num_rows), x.options());
  check_launch(dhp::scatter_rows(x.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>(), x.size(0), num_rows,
                                 row_bytes(x), current_stream(x)));
  return out;
}

// `tables` is int64 [2, num_samples + 1] on the tensor's device: cu_seqlens, then the per-rank shard offsets.
dhp::ZigzagLayout zigzag_layout(const at::Tensor& tables, const at::Tensor& x, int64_t group_size,
                                int64_t first_rank, int64_t num_ranks, int64_t rows_per_rank) {
  check_cuda(tables, "tables");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == 2 && tables.size(1) >= 1 &&
                  tables.is_contiguous(),
              "tables must be a contiguous int64 [2, num_samples + 1] tensor");
  TORCH_CHECK(tables.device() == x.device(), "tables are on ", tables.device(), " but the rows on ", x.device());
  TORCH_CHECK(group_size >= 1 && 0 <= first_rank && num_ranks >= 0 && first_rank + num_ranks <= group_size,
              "ranks [", first_rank, ", ", first_rank + num_ranks, ") do not fit a group of ", group_size);
  TORCH_CHECK(rows_per_rank >= 0, "rows_per_rank must be >= 0");
  const int64_t n = tables.size(1);
  const int64_t* base = tables.data_ptr<int64_t>();
  return dhp::ZigzagLayout{base, base + n, n - 1, group_size, first_rank, num_ranks, rows_per_rank};
}

at::Tensor zigzag_pack(const at::Tensor& x_in, const at::Tensor& tables, int64_t group_size, int64_t first_rank,
                       int64_t num_ranks, int64_t rows_per_rank, const at::Scalar& pad_value) {
  check_cuda(x_in, "x");
  TORCH_CHECK(x_in.dim() >= 1, "x must have a row dimension");
  const c10::DeviceGuard guard(x_in.device());
  const dhp::ZigzagLayout layout = zigzag_layout(tables, x_in, group_size, first_rank, num_ranks, rows_per_rank);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor pad = at::full(rows_like(x, 1), pad_value, x.options());
  at::Tensor out = at::empty(rows_like(x, num_ranks * rows_per_rank), x.options());
  check_launch(dhp::zigzag_pack(x.data_ptr(), out.data_ptr(), pad.data_ptr(), layout, row_bytes(x), current_stream(x)));
  return out;
}

at::Tensor zigzag_unpack(const at::Tensor& shard_in, const at::Tensor& tables, int64_t group_size, int64_t first_rank,
                         int64_t num_ranks, int64_t rows_per_rank, int64_t num_tokens) {
  check_cuda(shard_in, "shard");
  TORCH_CHECK(shard_in.dim() >= 1, "shard must have a row dimension");
  TORCH_CHECK(shard_in.size(0) == num_ranks * rows_per_rank, "shard has ", shard_in.size(0), " rows, the layout ",
              num_ranks * rows_per_rank);
  const c10::DeviceGuard guard(shard_in.device());
  const dhp::ZigzagLayout layout = zigzag_layout(tables, shard_in, group_size, first_rank, num_ranks, rows_per_rank);
  const at::Tensor shard = shard_in.contiguous();
  // every token is written when all ranks are given; otherwise the rows of other ranks read zero
  const auto shape = rows_like(shard, num_tokens);
  at::Tensor out = num_ranks == group_size ? at::empty(shape, shard.options()) : at::zeros(shape, shard.options());
  check_launch(dhp::zigzag_unpack(shard.data_ptr(), out.data_ptr(), layout, row_bytes(shard), current_stream(shard)));
  return out;
}

dhp::Float float_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return dhp::Float::kFloat32;
    case at::kHalf: return dhp::Float::kFloat16;
    case at::kBFloat16: return dhp::Float::kBFloat16;
    default: TORCH_CHECK(false, "lse_merge supports float32, float16 and bfloat16, got ", t.scalar_type());
  }
}

void check_merge_inputs(const at::Tensor& outs, const at::Tensor& lses) {
  check_cuda(outs, "outs");
  check_cuda(lses, "lses");
  TORCH_CHECK(outs.dim() == 4 && outs.size(0) >= 1, "outs must be [k >= 1, t, h, dh], got ", outs.sizes());
  TORCH_CHECK(lses.dim() == 3 && lses.sizes() == outs.sizes().slice(0, 3), "lses must be [k, t, h] matching outs ",
              outs.sizes(), ", got ", lses.sizes());
  TORCH_CHECK(lses.scalar_type() == at::kFloat, "lses must be float32");
  TORCH_CHECK(lses.device() == outs.device(), "outs and lses are on different devices");
}

at::Tensor lse_merge(const at::Tensor& outs_in, const at::Tensor& lses_in) {
  check_merge_inputs(outs_in, lses_in);
  const c10::DeviceGuard guard(outs_in.device());
  const at::Tensor outs = outs_in.contiguous(), lses = lses_in.contiguous();
  const int64_t k = outs.size(0), rows = outs.size(1) * outs.size(2), dim = outs.size(3);
  at::Tensor out = at::empty(outs.sizes().slice(1), outs.options());
  check_launch(dhp::lse_merge(outs.data_ptr(), lses.data_ptr<float>(), out.data_ptr(), k, rows, dim, float_kind(outs),
                              current_stream(outs)));
  return out;
}

std::tuple<at::Tensor, at::Tensor> lse_merge_backward(const at::Tensor& outs_in, const at::Tensor& lses_in,
                                           const at::Tensor& grad_in) {
  check_merge_inputs(outs_in, lses_in);
  check_cuda(grad_in, "grad");
  TORCH_CHECK(grad_in.sizes() == outs_in.sizes().slice(1) && grad_in.scalar_type() == outs_in.scalar_type() &&
                  grad_in.device() == outs_in.device(),
              "grad must match the merged output");
  const c10::DeviceGuard guard(outs_in.device());
  const at::Tensor outs = outs_in.contiguous(), lses = lses_in.contiguous(), grad = grad_in.contiguous();
  const int64_t k = outs.size(0), rows = outs.size(1) * outs.size(2), dim = outs.size(3);
  at::Tensor grad_outs = at::empty_like(outs), grad_lses = at::empty_like(lses);
  check_launch(dhp::lse_merge_backward(outs.data_ptr(), lses.data_ptr<float>(), grad.data_ptr(), grad_outs.data_ptr(),
                                       grad_lses.data_ptr<float>(), k, rows, dim, float_kind(outs),
                                       current_stream(outs)));
  return {grad_outs, grad_lses};
}

}  // namespace

TORCH_LIBRARY(megatron_dhp, m) {
  m.def("gather_rows(Tensor x, Tensor index) -> Tensor");
  m.def("scatter_rows(Tensor x, Tensor index, int num_rows) -> Tensor");
  m.def("zigzag_pack(Tensor x, Tensor tables, int group_size, int first_rank, int num_ranks, int rows_per_rank, "
        "Scalar pad_value) -> Tensor");
  m.def("zigzag_unpack(Tensor shard, Tensor tables, int group_size, int first_rank, int num_ranks, "
        "int rows_per_rank, int num_tokens) -> Tensor");
  m.def("lse_merge(Tensor outs, Tensor lses) -> Tensor");
  m.def("lse_merge_backward(Tensor outs, Tensor lses, Tensor grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_dhp, CUDA, m) {
  m.impl("gather_rows", &gather_rows);
  m.impl("scatter_rows", &scatter_rows);
  m.impl("zigzag_pack", &zigzag_pack);
  m.impl("zigzag_unpack", &zigzag_unpack);
  m.impl("lse_merge", &lse_merge);
  m.impl("lse_merge_backward", &lse_merge_backward);
}
