"""Ring (P2P) context parallelism: K/V blocks travel around the group, partial outputs merge by log-sum-exp.

Each rank only ever holds its own K/V block plus the one in flight, and works for any group size >= 2. The
backward pass is autograd through the differentiable ring shift (gradients travel the ring the other way),
which is exact; it keeps the received blocks for backward instead of re-fetching them. The merge is
`fused.lse_merge`: one CUDA kernel forward and backward on GPU, `merge_partials` itself on CPU.
"""

from __future__ import annotations

import torch

from megatron_dhp.runtime.attention.comm import ring_shift
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.math import block_attention, visible
from megatron_dhp.runtime.fused import lse_merge


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, scale: float) -> torch.Tensor:
    """Causal attention of the local queries, visiting every rank's K/V block once; [t, h, dh] in and out."""
    layout, group = ctx.layout, ctx.group
    size, rank = layout.group_size, layout.rank
    q_pos = layout.local_positions.to(q.device)
    seg = layout.segments.to(q.device)
    kv = torch.stack((k, v))
    outs, lses = [], []
    for step in range(size):
        source = (rank - step) % size
        mask = visible(q_pos, layout.positions(source).to(q.device), seg, seg)
        out, lse = block_attention(q, kv[0], kv[1], mask, scale)
        outs.append(out)
        lses.append(lse)
        if step < size - 1:
            kv = ring_shift(kv, group)
    return lse_merge(outs, lses)
