"""All-gather context parallelism: every rank gathers the group's keys and values, attends its own queries.

Communication is exposed (one all-gather of K and V per layer, a reduce-scatter of dK and dV in backward),
but it is the simplest exact variant and works for any group size, head count and GQA layout.
"""

from __future__ import annotations

import torch

from megatron_dhp.runtime.attention.comm import all_gather
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.kernels import attend
from megatron_dhp.runtime.attention.tokens import Tokens


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, scale: float) -> torch.Tensor:
    """Causal attention of the local queries over all keys of the group; [t, h, dh] in, [t, h, dh] out."""
    layout = ctx.layout
    keys = Tokens(layout.group_positions, layout.group_segments, whole_samples=layout)
    queries = Tokens(layout.local_positions, layout.segments)
    return attend(q, all_gather(k, ctx.group), all_gather(v, ctx.group), queries, keys, scale, ctx.backend)
