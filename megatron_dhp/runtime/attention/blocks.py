"""Attention of a rank's queries over one K/V block that returns the log-sum-exp, and its backward from it.

The ring merges per-block outputs by their log-sum-exp, and its backward recomputes every block from the
merged output and log-sum-exp (flash attention's backward), so nothing per block lives between the passes.
Queries go in chunks of `QUERY_CHUNK` rows, each with one additive mask trimmed to the key columns it can
see: the transient is O(chunk x block), never [heads, t, t] scores, and a chunk that sees nothing in the
block (half of each zigzag ring step, every other document) costs nothing. The kernel behind a chunk is the
device's fused attention that returns the log-sum-exp, or the explicit fp32 reference (`math`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_dhp.runtime.attention.math import MASKED, accumulation_dtype, visible, widened

QUERY_CHUNK = 1024
"""Queries per kernel call: bounds the mask (and `math`'s scores) to QUERY_CHUNK x block keys."""


@dataclass(frozen=True)
class Chunk:
    """Query rows `rows` see only key columns `cols` of the block; `bias` [rows, cols] is 0 or `MASKED`."""

    rows: slice
    cols: slice
    bias: torch.Tensor


def chunks(queries: tuple[torch.Tensor, torch.Tensor], keys: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
           device: torch.device) -> list[Chunk]:
    """The (query chunk, visible key range) pairs of a block from (positions, segments) of queries and keys."""
    (q_pos, q_seg), (k_pos, k_seg) = queries, keys
    out = []
    for start in range(0, q_pos.numel(), QUERY_CHUNK):
        rows = slice(start, start + QUERY_CHUNK)
        mask = visible(q_pos[rows], k_pos, q_seg[rows], k_seg)
        cols = torch.nonzero(mask.any(dim=0)).view(-1)
        if cols.numel() == 0:
            continue
        lo, hi = int(cols[0]), int(cols[-1]) + 1
        bias = torch.zeros(mask.shape[0], hi - lo, dtype=dtype).masked_fill_(~mask[:, lo:hi], _masked(dtype))
        out.append(Chunk(rows, slice(lo, hi), bias.to(device)))
    return out


class LseKernel(Protocol):
    """Attention over one chunk, heads first ([h, tq, dh] queries, [h, tk, dh] keys/values, one kv per head)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output [h, tq, dh] and log-sum-exp [h, tq] (fp32, fp64 for fp64) of the scaled, biased scores."""

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv of this chunk given the *merged* output and log-sum-exp over every block."""


class MathKernel:
    """Explicit scores in fp32 (the reference; any device and dtype)."""

    def forward(self, q, k, v, bias, scale):  # noqa: D102
        acc = accumulation_dtype(q.dtype)
        scores = torch.baddbmm(bias.to(acc).expand(q.shape[0], -1, -1), q.to(acc), k.to(acc).transpose(1, 2), alpha=scale)
        lse = torch.logsumexp(scores, dim=-1)
        return torch.bmm(torch.exp(scores - lse[..., None]), v.to(acc)).to(q.dtype), lse

    def backward(self, grad, q, k, v, bias, out, lse, scale):  # noqa: D102
        acc = accumulation_dtype(q.dtype)
        q, k, v, grad = q.to(acc), k.to(acc), v.to(acc), grad.to(acc)
        scores = torch.baddbmm(bias.to(acc).expand(q.shape[0], -1, -1), q, k.transpose(1, 2), alpha=scale)
        probs = torch.exp(scores - lse[..., None])
        d = (grad * out.to(acc)).sum(dim=-1, keepdim=True)
        ds = probs * (torch.bmm(grad, v.transpose(1, 2)) - d)
        return torch.bmm(ds, k) * scale, torch.bmm(ds.transpose(1, 2), q) * scale, torch.bmm(probs.transpose(1, 2), grad)


class CpuFlashKernel:
    """torch's tiled CPU flash attention, which returns the log-sum-exp and takes it back in backward."""

    def forward(self, q, k, v, bias, scale):  # noqa: D102
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, False, attn_mask=bias, scale=scale
        )
        return out[0], lse[0]

    def backward(self, grad, q, k, v, bias, out, lse, scale):  # noqa: D102
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad[None], q[None], k[None], v[None], out[None], lse[None], 0.0, False, attn_mask=bias, scale=scale
        )
        return dq[0], dk[0], dv[0]


class CudaEfficientKernel:
    """torch's memory-efficient CUDA attention (takes an additive bias, returns the log-sum-exp)."""

    def forward(self, q, k, v, bias, scale):  # noqa: D102
        q, k, v = (x.contiguous()[None] for x in (q, k, v))
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _aligned(bias, q.shape[1]), True, 0.0, False, scale=scale
        )
        return out[0], lse[0, :, : q.shape[2]]

    def backward(self, grad, q, k, v, bias, out, lse, scale):  # noqa: D102
        grad, q, k, v, out = (x.contiguous()[None] for x in (grad, q, k, v, out))
        rows = q.shape[2]
        padded = lse.new_zeros(1, lse.shape[0], -(-rows // 32) * 32)  # the forward pads the lse to 32 rows
        padded[0, :, :rows] = lse
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # unused without dropout
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, _aligned(bias, q.shape[1]), out, padded, seed, offset,
            0.0, [True, True, True, False], False, scale=scale,
        )
        return dq[0], dk[0], dv[0]


LSE_KERNELS: dict[str, LseKernel] = {"math": MathKernel(), "cpu": CpuFlashKernel(), "cuda": CudaEfficientKernel()}
"""Kernels by name; `lse_kernel` picks one for a backend and a device."""


def lse_kernel(backend: str, q: torch.Tensor) -> LseKernel:
    """`math` for the math backend, else the device's fused kernel (flash-attn's varlen kernel takes no mask)."""
    if backend == "math":
        return LSE_KERNELS["math"]
    return LSE_KERNELS["cuda" if q.is_cuda else "cpu"]


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts: list[Chunk], scale: float,
                  kernel: LseKernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads-first q [h, t, dk] over one block (k [h, tk, dk], v [h, tk, dv]): output [h, t, dv], lse [h, t]
    (`MASKED` where unseen). The fused kernels take one head size: a narrower V (MLA's) runs `widened`."""
    dv, v = v.shape[-1], widened(v, q.shape[-1])
    out = q.new_zeros(*q.shape[:2], v.shape[-1])
    lse = torch.full(q.shape[:2], MASKED, dtype=accumulation_dtype(q.dtype), device=q.device)
    for c in parts:
        out[:, c.rows], lse[:, c.rows] = kernel.forward(q[:, c.rows], k[:, c.cols], v[:, c.cols], c.bias, scale)
    return out[..., :dv], lse


def block_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, parts: list[Chunk], scale: float, kernel: LseKernel
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dq and its dk, dv (fp32), from the merged output and lse of the forward."""
    acc, width, narrow = accumulation_dtype(q.dtype), q.shape[-1], v.shape[-1]
    grad, v, out = (widened(x, width) for x in (grad, v, out))  # a narrower V as block_forward ran it
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k, v))
    for c in parts:
        r, s = c.rows, c.cols
        gq, gk, gv = kernel.backward(grad[:, r], q[:, r], k[:, s], v[:, s], c.bias, out[:, r], lse[:, r], scale)
        dq[:, r] += gq
        dk[:, s] += gk
        dv[:, s] += gv
    return dq, dk, dv[..., :narrow]


def _masked(dtype: torch.dtype) -> float:
    """`MASKED`, or the dtype's lowest value where -1e30 would round to -inf (fp16)."""
    return max(MASKED, torch.finfo(dtype).min)


def _aligned(bias: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, heads, rows, cols] view of a buffer whose rows are a multiple of 16 wide, as SDPA hands the efficient kernel."""
    rows, cols = bias.shape
    buffer = bias.new_empty(rows, -(-cols // 16) * 16)
    buffer[:, :cols] = bias
    return buffer[:, :cols].expand(1, heads, rows, cols)
