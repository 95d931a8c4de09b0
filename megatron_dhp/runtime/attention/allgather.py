"""All-gather context parallelism: every rank gathers the group's keys and values, attends its own queries.

Communication is exposed (one all-gather of K and V per layer, a reduce-scatter of dK and dV in backward),
but it is the simplest exact variant and works for any group size, head count and GQA layout.
"""

from __future__ import annotations

import torch

from megatron_dhp.runtime.attention.comm import all_gather
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.kernels import LocalKernel


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, kernel: LocalKernel,
                        scale: float) -> torch.Tensor:
    """Causal attention of the local queries over all keys of the group; [t, h, dh] in, [t, h, dh] out."""
    return kernel.gathered(q, all_gather(k, ctx.group), all_gather(v, ctx.group), ctx.meta, scale)
