"""Ring (P2P) context parallelism in O(one block) of memory: K/V travel the ring in forward and again in backward.

Forward: each rank attends its queries to the K/V block in hand while the next block is in flight, and merges
the partial output into a running one by log-sum-exp (`fused.lse_merge`). It keeps only q, its own k/v, the
merged output and log-sum-exp, however large the group. Backward sends K/V around the ring again, each block
travelling with its dK/dV accumulator: every rank recomputes its queries' share of the block's gradients from
the merged output and log-sum-exp (flash attention's backward, `LocalKernel.block_backward`), adds it and
passes the pair on; after a full turn the accumulator arrives home complete. This is the scheme of
TransformerEngine's P2P context parallelism and of ring-flash-attention; any group size >= 2 works.

With zigzag shards a step's block is, sample by sample, causal (step 0), every query over the front chunks
(a block from an earlier group rank) or the back-chunk queries over everything (from a later one), so a step
is one kernel call of a kind the microbatch's metadata describes (`AttentionMeta.ring_block`): no mask.
Under uneven shards blocks differ in size: each receive is sized by the layout (`AttentionMeta.ring_rows`),
never by a message, and a block's dK/dV accumulator has its block's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from megatron_dhp.runtime.attention.comm import Shift, start_shift
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.kernels import LocalKernel
from megatron_dhp.runtime.attention.math import accumulation_dtype, finite_lse
from megatron_dhp.runtime.attention.meta import AttentionMeta, RingBlock
from megatron_dhp.runtime.fused import lse_merge

_KV, _GRAD_KV = 0, 1
"""Tags of the two shifts that can be in flight at once in backward."""


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, kernel: LocalKernel,
                   scale: float) -> torch.Tensor:
    """Causal attention of the local queries, visiting every rank's K/V block once; [t, h, dh] in and out."""
    return _RingAttention.apply(q, k, v, ctx, kernel, scale)


def merged_blocks(q: torch.Tensor, blocks: Iterable[tuple[RingBlock, torch.Tensor, torch.Tensor]],
                  kernel: LocalKernel, meta: AttentionMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries' attention over every (step, k, v) block, merged by log-sum-exp: output (fp32) and lse [t, h]."""
    out = lse = None
    for block, k, v in blocks:
        o, s = kernel.block(q, k, v, block, meta, scale)
        o, s = o.to(s.dtype), finite_lse(s)  # (flash attention's empty key range: +inf)
        out, lse = (o, s) if out is None else (lse_merge([out, o], [lse, s]), torch.logaddexp(lse, s))
    return out, lse


def _shifted(kv: torch.Tensor, cp: CPContext, dk: int) -> Iterator[tuple[RingBlock, torch.Tensor, torch.Tensor]]:
    """This rank's K/V block, then each block the ring brings, the next one in flight while one is computed."""
    size, meta = cp.layout.group_size, cp.meta
    for step in range(size):
        pending = _shift(kv, cp, _KV, step) if step < size - 1 else None
        yield meta.ring_block(step), kv[..., :dk], kv[..., dk:]
        if pending is not None:
            kv = pending.wait()


def _shift(x: torch.Tensor, cp: CPContext, tag: int, step: int) -> Shift:
    """`start_shift` of `x` during ring step `step`, receiving the block of the next step: of `x`'s size under
    even shards, of its source rank's under uneven ones (`AttentionMeta.ring_rows`)."""
    if not cp.layout.uneven:
        return start_shift(x, cp.group, tag)
    return start_shift(x, cp.group, tag, cp.meta.ring_rows(step))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext,  # noqa: D102
                kernel: LocalKernel, scale: float) -> torch.Tensor:
        out, lse = merged_blocks(q, _shifted(torch.cat((k, v), dim=-1), cp, k.shape[-1]), kernel, cp.meta, scale)
        out = out.to(q.dtype)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.cp, fctx.kernel, fctx.scale = cp, kernel, scale
        return out

    @staticmethod
    def backward(fctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:  # noqa: D102
        q, k, v, out, lse = fctx.saved_tensors
        cp, kernel, scale = fctx.cp, fctx.kernel, fctx.scale
        size, meta = cp.layout.group_size, cp.meta
        kv, dk = torch.cat((k, v), dim=-1), k.shape[-1]
        dq = torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        grad_kv = None
        for step in range(size):
            pending = _shift(kv, cp, _KV, step) if step < size - 1 else None
            gq, gk, gv = kernel.block_backward(grad, q, kv[..., :dk], kv[..., dk:], out, lse, meta.ring_block(step),
                                               meta, scale)
            dq += gq
            block = torch.cat((gk, gv), dim=-1)
            # the accumulator of the block in hand arrives from the rank behind, which held this block last step
            grad_kv = block if grad_kv is None else grad_kv.wait() + block
            grad_kv = _shift(grad_kv, cp, _GRAD_KV, step)
            if pending is not None:
                kv = pending.wait()
        grad_kv = grad_kv.wait()  # after a full turn: this rank's own block, with every rank's share
        return dq.to(q.dtype), grad_kv[..., :dk].to(k.dtype), grad_kv[..., dk:].to(v.dtype), None, None, None
