"""All-gather context parallelism: every rank gathers the group's keys and values, attends its own queries.

Communication is exposed (one all-gather of K and V per layer, a reduce-scatter of dK and dV in backward),
but it is the simplest exact variant and works for any group size, head count and GQA layout. Under uneven
shards the blocks travel padded to the largest (`comm.all_gather_padded`).
"""

from __future__ import annotations

import torch

from megatron_dhp.runtime.attention.comm import all_gather, all_gather_padded
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.kernels import LocalKernel


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, kernel: LocalKernel,
                        scale: float) -> torch.Tensor:
    """Causal attention of the local queries over all keys of the group; [t, h, dh] in, [t, h, dh] out."""
    meta = ctx.meta
    if meta.gather_keep is None:
        k, v = all_gather(k, ctx.group), all_gather(v, ctx.group)
    else:  # uneven shards: blocks of different sizes
        width = max(ctx.layout.rank_slots)
        k, v = (all_gather_padded(x, ctx.group, width, meta.gather_keep) for x in (k, v))
    return kernel.gathered(q, k, v, meta, scale)
