"""Ring (P2P) context parallelism in O(one block) of memory: K/V travel the ring in forward and again in backward.

Forward: each rank attends its queries to the K/V block in hand while the next block is in flight, and merges
the partial output into a running one by log-sum-exp (`fused.lse_merge`). It keeps only q, its own k/v, the
merged output and log-sum-exp, however large the group. Backward sends K/V around the ring again, each block
travelling with its dK/dV accumulator: every rank recomputes its queries' share of the block's gradients from
the merged output and log-sum-exp (flash attention's backward, `blocks.block_backward`), adds it and passes
the pair on; after a full turn the accumulator arrives home complete. This is the scheme of TransformerEngine's
P2P context parallelism and of ring-flash-attention; any group size >= 2 works (1 takes no step).
"""

from __future__ import annotations

import torch

from megatron_dhp.runtime.attention.blocks import Chunk, block_backward, block_forward, chunks, lse_kernel
from megatron_dhp.runtime.attention.comm import start_shift
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.math import accumulation_dtype, expand_kv_heads
from megatron_dhp.runtime.fused import lse_merge

_KV, _GRAD_KV = 0, 1
"""Tags of the two shifts that can be in flight at once in backward."""


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, scale: float) -> torch.Tensor:
    """Causal attention of the local queries, visiting every rank's K/V block once; [t, h, dh] in and out."""
    return _RingAttention.apply(q, k, v, ctx, scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext, scale: float  # noqa: D102
                ) -> torch.Tensor:
        kernel, size = lse_kernel(cp.backend, q), cp.layout.group_size
        q_h, kv, dk = q.transpose(0, 1), torch.cat((k, v), dim=-1), k.shape[-1]
        out = lse = None
        for step in range(size):
            pending = start_shift(kv, cp.group, _KV) if step < size - 1 else None
            parts = _chunks(cp, step, q)
            if parts:  # step 0 always has some: every query sees itself
                o, s = block_forward(q_h, *_heads_first(kv, q.shape[1], dk), parts, scale, kernel)
                o = o.to(s.dtype)
                out, lse = (o, s) if out is None else (lse_merge([out, o], [lse, s]), torch.logaddexp(lse, s))
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype).transpose(0, 1).contiguous()
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.cp, fctx.scale = cp, scale
        return out

    @staticmethod
    def backward(fctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:  # noqa: D102
        q, k, v, out, lse = fctx.saved_tensors
        cp, scale = fctx.cp, fctx.scale
        kernel, size, heads = lse_kernel(cp.backend, q), cp.layout.group_size, q.shape[1]
        acc = accumulation_dtype(q.dtype)
        q_h, grad_h, out_h = q.transpose(0, 1), grad.transpose(0, 1), out.transpose(0, 1)
        kv, dk = torch.cat((k, v), dim=-1), k.shape[-1]
        dq = torch.zeros(q_h.shape, dtype=acc, device=q.device)
        grad_kv = None
        for step in range(size):
            pending = start_shift(kv, cp.group, _KV) if step < size - 1 else None
            block = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            parts = _chunks(cp, step, q)
            if parts:
                gq, gk, gv = block_backward(grad_h, q_h, *_heads_first(kv, heads, dk), out_h, lse, parts, scale, kernel)
                dq += gq
                block[..., :dk], block[..., dk:] = _sum_kv_heads(gk, kv.shape[1]), _sum_kv_heads(gv, kv.shape[1])
            # the accumulator of the block in hand arrives from the rank behind, which held this block last step
            grad_kv = block if grad_kv is None else grad_kv.wait() + block
            grad_kv = start_shift(grad_kv, cp.group, _GRAD_KV)
            if pending is not None:
                kv = pending.wait()
        grad_kv = grad_kv.wait()  # after a full turn: this rank's own block, with every rank's share
        return dq.transpose(0, 1).to(q.dtype), grad_kv[..., :dk].to(k.dtype), grad_kv[..., dk:].to(v.dtype), None, None


def _chunks(cp: CPContext, step: int, q: torch.Tensor) -> list[Chunk]:
    """The visible (query chunk, key range) pairs of ring step `step`: the block of group rank r - step."""
    layout = cp.layout
    source = (layout.rank - step) % layout.group_size
    return chunks((layout.local_positions, layout.segments), (layout.positions(source), layout.segments), q.dtype, q.device)


def _heads_first(kv: torch.Tensor, heads: int, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V side by side, [t, hk, dk + dv] (one tensor travels the ring; MLA's V is narrower than its K), as
    [h, t, dk] and [h, t, dv], GQA heads repeated to one per query head."""
    return tuple(expand_kv_heads(x, heads).transpose(0, 1) for x in (kv[..., :dk], kv[..., dk:]))


def _sum_kv_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[h, t, dh] gradient of repeated heads -> [t, hk, dh]: each kv head sums over the query heads it serves."""
    h, t, dh = grad.shape
    return grad.transpose(0, 1).reshape(t, kv_heads, h // kv_heads, dh).sum(dim=2)
