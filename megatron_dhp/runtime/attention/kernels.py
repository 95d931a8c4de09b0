"""Local attention kernels behind one call: which keys each query sees comes from token positions.

`math` is the reference (explicit softmax in fp32), `sdpa` is torch's fused attention with the same mask,
`flash` is flash-attn's varlen kernel on CUDA (bf16/fp16), reached by reordering whole samples into
natural token order. `auto` takes flash when it applies and sdpa otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention import flash
from megatron_dhp.runtime.attention.math import block_attention, sdpa_attention, visible
from megatron_dhp.runtime.layout import MicrobatchLayout


@dataclass(frozen=True)
class Tokens:
    """Sample index and true position of each row of a q/k/v tensor."""

    positions: torch.Tensor
    segments: torch.Tensor
    whole_samples: MicrobatchLayout | None = None
    """Set when the rows are every slot of every sample of this layout, in group (rank-major) order:
    then they can be sorted into natural order for a varlen kernel."""


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    queries: Tokens,
    keys: Tokens,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Causal attention of `q` over `k`/`v` ([t, h, dh], GQA allowed); every query must see itself."""
    if backend == "auto":
        backend = "flash" if flash.usable(q) and keys.whole_samples is not None else "sdpa"
    if backend == "flash":
        if keys.whole_samples is None:
            raise DhpError("the flash backend needs whole samples as keys; use comm allgather or ulysses")
        return flash.attend(q, k, v, queries, keys.whole_samples, scale)
    device = q.device
    mask = visible(
        queries.positions.to(device), keys.positions.to(device), queries.segments.to(device), keys.segments.to(device)
    )
    if backend == "math" or q.shape[1] == 0:
        return block_attention(q, k, v, mask, scale)[0]
    return sdpa_attention(q, k, v, mask, scale)
