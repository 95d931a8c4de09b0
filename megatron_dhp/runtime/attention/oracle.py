"""The `math` kernel: explicit scores in fp32 under a mask built on the device, the oracle of every backend.

Its masks come from the microbatch's device tensors (`AttentionMeta`), so it too reads nothing on the host
inside a layer; it costs O(t^2) memory and runs on any device and dtype.
"""

from __future__ import annotations

import torch

from megatron_dhp.runtime.attention.math import (
    MASKED,
    accumulation_dtype,
    block_attention,
    expand_kv_heads,
    sum_kv_heads,
    visible,
)
from megatron_dhp.runtime.attention.meta import BACK_QUERIES, DIAGONAL, AttentionMeta, RingBlock, Spans


def ring_block_mask(block: RingBlock, meta: AttentionMeta) -> torch.Tensor:
    """[t, t'] boolean over this rank's rows and the block's: which keys of ring step `block` each query sees."""
    same = meta.segments[:, None] == block.keys.spans.row_segments()[None, :]
    if block.kind == DIAGONAL:
        rows = torch.arange(meta.positions.numel(), device=meta.device)
        return same & (rows[None, :] <= rows[:, None])
    return same & (~meta.shard.front()[:, None] if block.kind == BACK_QUERIES else block.keys.front()[None, :])


class MathKernel:
    """Explicit scores in fp32 under a boolean mask built on the device (the reference; any device and dtype)."""

    def applies(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:  # noqa: D102
        return None

    def causal(self, q, k, v, spans: Spans, scale: float) -> torch.Tensor:  # noqa: D102
        seg, rows = spans.row_segments(), torch.arange(spans.total, device=q.device)
        return block_attention(q, k, v, (seg[:, None] == seg[None, :]) & (rows[None, :] <= rows[:, None]), scale)[0]

    def gathered(self, q, k, v, meta: AttentionMeta, scale: float) -> torch.Tensor:  # noqa: D102
        positions, segments = meta.group_rows()
        return block_attention(q, k, v, visible(meta.positions, positions, meta.segments, segments), scale)[0]

    def block(self, q, k, v, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        mask = ring_block_mask(block, meta)
        out, lse = block_attention(q, k, v, mask, scale)
        return out.masked_fill(~mask.any(dim=1)[:, None, None], 0), lse

    def block_backward(self, grad, q, k, v, out, lse, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        acc, h, hk = accumulation_dtype(q.dtype), q.shape[1], k.shape[1]
        q, grad, out = (x.to(acc).transpose(0, 1) for x in (q, grad, out))
        k, v = (expand_kv_heads(x, h).to(acc).transpose(0, 1) for x in (k, v))
        scores = torch.bmm(q, k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~ring_block_mask(block, meta), MASKED)
        probs = torch.exp(scores - lse.to(acc).transpose(0, 1)[..., None])
        d = (grad * out).sum(dim=-1, keepdim=True)
        ds = probs * (torch.bmm(grad, v.transpose(1, 2)) - d)
        dq = torch.bmm(ds, k) * scale
        dk, dv = torch.bmm(ds.transpose(1, 2), q) * scale, torch.bmm(probs.transpose(1, 2), grad)
        return dq.transpose(0, 1), sum_kv_heads(dk.transpose(0, 1), hk), sum_kv_heads(dv.transpose(0, 1), hk)
