"""The `flex` kernel: FlexAttention with one block mask per microbatch and question, built once, reused by
every layer.

A mask is a predicate on row indices over the microbatch's device tensors (`AttentionMeta`): same sample and
key not after the query (causal samples, the all-gather's group rows by true position), or a ring step's kind
(own block causal, an earlier rank's front chunks, a later rank's back-chunk queries). `create_block_mask`
turns it into a `BlockMask` (compiled on a GPU, so the dense predicate is never materialised), cached in the
metadata, so the number of operations a layer issues does not depend on the number of samples. On a GPU
`flex_attention` is compiled by Triton (fp32 and head sizes flash attention lacks included); on a CPU torch
runs its forward only, so `flex` there serves as a forward-only check, never `auto`'s choice.

Ring backward: FlexAttention has no entry that takes a merged log-sum-exp back, so each step's block is
recomputed with autograd and differentiated through its own output and log-sum-exp, weighted by its share of
the merged softmax (w = exp(lse_block - lse_merged)): dO_block = w dO, dlse_block = w <dO, O_block - O>.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention.math import MASKED, accumulation_dtype, widened
from megatron_dhp.runtime.attention.meta import BACK_QUERIES, DIAGONAL, AttentionMeta, RingBlock, Spans


class FlexKernel:
    """FlexAttention (see the module docstring)."""

    def applies(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:  # noqa: D102
        if device_type == "cuda" and not _has_triton():
            return "FlexAttention on a GPU needs Triton"
        if device_type not in ("cuda", "cpu"):
            return f"FlexAttention runs on CUDA or (forward only) the CPU, not {device_type}"
        if head_dim < 16:
            return f"FlexAttention needs a head size of at least 16, not {head_dim}"
        return None

    def causal(self, q, k, v, spans: Spans, scale: float) -> torch.Tensor:  # noqa: D102
        if "flex-causal" not in spans.cache:
            seg = spans.row_segments()
            spans.cache["flex-causal"] = _block_mask(lambda b, h, i, j: (seg[i] == seg[j]) & (j <= i),
                                                     spans.total, spans.total, seg.device)
        return _attend(q, k, v, spans.cache["flex-causal"], scale)[0]

    def gathered(self, q, k, v, meta: AttentionMeta, scale: float) -> torch.Tensor:  # noqa: D102
        if "flex-gathered" not in meta.cache:
            q_pos, q_seg = meta.positions, meta.segments
            k_pos, k_seg = meta.group_rows()
            meta.cache["flex-gathered"] = _block_mask(
                lambda b, h, i, j: (q_seg[i] == k_seg[j]) & (k_pos[j] <= q_pos[i]), q_pos.numel(), k_pos.numel(),
                meta.device)
        return _attend(q, k, v, meta.cache["flex-gathered"], scale)[0]

    def block(self, q, k, v, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        with torch.no_grad():
            out, lse = _attend(q, k, v, _ring_mask(block, meta), scale)
        return out, lse

    def block_backward(self, grad, q, k, v, out, lse, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        acc = accumulation_dtype(q.dtype)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            o, s = _attend(*leaves, _ring_mask(block, meta), scale)
            weight = torch.exp(s.to(acc) - lse.to(acc))  # this block's share of each row's merged softmax
            grad_o = (grad.to(acc) * weight[..., None]).to(o.dtype)
            grad_s = weight * (grad.to(acc) * (o.to(acc) - out.to(acc))).sum(dim=-1)
            dq, dk, dv = torch.autograd.grad((o, s), leaves, (grad_o, grad_s.to(s.dtype)))
        return dq.to(acc), dk.to(acc), dv.to(acc)


def _ring_mask(block: RingBlock, meta: AttentionMeta):
    """The block mask of ring step `block`, this rank's rows over the block's (cached per microbatch)."""
    key = f"flex-{block.name}"
    if key not in meta.cache:
        seg, keys = meta.segments, block.keys
        key_seg = keys.spans.row_segments()
        if block.kind == DIAGONAL:
            def mask(b, h, i, j):
                return (seg[i] == key_seg[j]) & (j <= i)
        elif block.kind == BACK_QUERIES:
            front = meta.shard.front()

            def mask(b, h, i, j):
                return (seg[i] == key_seg[j]) & ~front[i]
        else:
            front = keys.front()

            def mask(b, h, i, j):
                return (seg[i] == key_seg[j]) & front[j]
        meta.cache[key] = _block_mask(mask, seg.numel(), key_seg.numel(), meta.device)
    return meta.cache[key]


def _block_mask(mask: Callable, rows: int, cols: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask, None, None, rows, cols, device=device, _compile=device.type == "cuda")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """[t, h, d] FlexAttention under `block_mask`: output [t, h, dv] and log-sum-exp [t, h] (`MASKED` where a
    query sees nothing)."""
    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise DhpError("FlexAttention runs forward only on a CPU (torch has no CPU backward for it); use the "
                       "sdpa backend there, or flex under torch.no_grad()")
    dv, h = v.shape[-1], q.shape[1]
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, widened(v, q.shape[-1])))
    out, lse = _flex(q.is_cuda)(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != h,
                                return_lse=True)
    return out[0].transpose(0, 1)[..., :dv], lse[0].transpose(0, 1).clamp(min=MASKED)


@functools.cache
def _flex(cuda: bool) -> Callable:
    """`flex_attention`, compiled on a GPU (eager FlexAttention is a slow reference there)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if cuda else flex_attention


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
