"""A context-parallel group of d ranks run in one process: every rank's attention with the communication done
by indexing, so any backend's variants can be checked against the oracle (and timed) on one device.

Each virtual rank gets its zigzag shards of whole samples; `allgather` hands every rank the group's rows,
`ulysses` its samples whole (all heads: the head split changes which rank computes a head, not the math), and
the ring visits every source block in ring order with the real merge (`ring.merged_blocks`) and the real
backward kernel, each block's dK/dV added straight to its owner instead of travelling with it.
"""

from __future__ import annotations

import torch

from megatron_dhp.runtime.attention.kernels import LocalKernel
from megatron_dhp.runtime.attention.math import accumulation_dtype
from megatron_dhp.runtime.attention.meta import AttentionMeta
from megatron_dhp.runtime.attention.ring import merged_blocks
from megatron_dhp.runtime.fused import zigzag_pack, zigzag_unpack
from megatron_dhp.runtime.layout import MicrobatchLayout


def virtual_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor | None,
                  lengths: tuple[int, ...], size: int, comm: str, kernel: LocalKernel, scale: float
                  ) -> tuple[torch.Tensor, ...]:
    """Output and dq, dk, dv, in whole-sample order, of `size` virtual ranks attending `lengths`' samples
    (whole [T, heads, dim] tensors in, `grad` the output's gradient; None: the output alone, forward only)
    with `comm` (`allgather`, `ulysses`, `ring` or `p2p`, which is the ring) on `kernel`."""
    metas = [AttentionMeta.build(MicrobatchLayout(tuple(range(len(lengths))), lengths, size, r), q.device)
             for r in range(size)]
    cu = metas[0].layout.cu_seqlens

    def shards(x: torch.Tensor) -> list[torch.Tensor]:
        return list(zigzag_pack(x, cu, size, None).chunk(size))

    def whole(parts: list[torch.Tensor]) -> torch.Tensor:
        return zigzag_unpack(torch.cat(parts), cu, size, None)

    if comm in ("ring", "p2p") and size > 1:
        qs, ks, vs = (shards(x) for x in (q, k, v))
        gs = shards(grad) if grad is not None else None
        outs, dqs = [], []
        acc = accumulation_dtype(q.dtype)
        dks, dvs = ([torch.zeros_like(x, dtype=acc) for x in xs] for xs in (ks, vs))
        for r, meta in enumerate(metas):
            sources = [(r - step) % size for step in range(size)]
            out, lse = merged_blocks(qs[r], [(meta.ring_block(s), ks[j], vs[j]) for s, j in enumerate(sources)],
                                     kernel, meta, scale)
            out = out.to(q.dtype)
            outs.append(out)
            if grad is None:
                continue
            dq = torch.zeros_like(qs[r], dtype=acc)
            for s, j in enumerate(sources):
                gq, gk, gv = kernel.block_backward(gs[r], qs[r], ks[j], vs[j], out, lse, meta.ring_block(s), meta,
                                                   scale)
                dq += gq
                dks[j] += gk
                dvs[j] += gv
            dqs.append(dq)
        if grad is None:
            return (whole(outs),)
        return whole(outs), whole(dqs).to(q.dtype), whole(dks).to(k.dtype), whole(dvs).to(v.dtype)
    leaves = [x.detach().requires_grad_(grad is not None) for x in (q, k, v)]
    if size == 1 or comm == "ulysses":
        natural = metas[0].natural if size > 1 else metas[0].local
        padded = [metas[0].zigzag.unpack(zigzag_pack(x, cu, size, None)) for x in leaves]  # samples padded whole
        out_padded = kernel.causal(*padded, natural, scale)
        out = whole(list(zigzag_pack(out_padded, metas[0].layout.cu_seqlens_padded, size, None).chunk(size)))
    else:
        qs, ks, vs = (shards(x) for x in leaves)
        group_k, group_v = torch.cat(ks), torch.cat(vs)
        out = whole([kernel.gathered(qs[r], group_k, group_v, meta, scale) for r, meta in enumerate(metas)])
    if grad is None:
        return (out,)
    dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return out.detach(), dq, dk, dv


def host_group_rows(layout: MicrobatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, sample indices) of every group rank's slots, rank-major (an all-gather's order), from the
    layout on the host, rank by rank: the oracle of `AttentionMeta.group_rows`, which derives them on the device."""
    ranks = range(layout.group_size)
    return torch.cat([layout.positions(r) for r in ranks]), torch.cat([layout.segments_of(r) for r in ranks])
