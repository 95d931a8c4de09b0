"""Local attention kernels behind one call: which keys each query sees comes from token positions.

`math` is the reference (explicit softmax in fp32 over the whole microbatch under one mask), `sdpa` is
torch's fused attention run sample by sample, `flash` is flash-attn's varlen kernel on CUDA (bf16/fp16),
reached by reordering whole samples into natural token order. `auto` takes flash when it applies and sdpa
otherwise. sdpa goes sample by sample so that a packed microbatch costs sum L^2 like a varlen kernel, not
(sum L)^2: on the CPU, where it is the kernel in use, step time then follows the cost model's form.
"""

from __future__ import annotations

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention import flash
from megatron_dhp.runtime.attention.math import block_attention, sdpa_attention, visible
from megatron_dhp.runtime.attention.tokens import Tokens


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
    if backend == "math" or q.shape[1] == 0:
        return block_attention(q, k, v, _mask(queries, keys, q.device), scale)[0]
    return _sdpa_by_sample(q, k, v, queries, keys, scale)


def _mask(queries: Tokens, keys: Tokens, device: torch.device) -> torch.Tensor:
    return visible(
        queries.positions.to(device), keys.positions.to(device), queries.segments.to(device), keys.segments.to(device)
    )


def _sdpa_by_sample(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: Tokens, keys: Tokens, scale: float) -> torch.Tensor:
    """SDPA once per sample of the queries, over that sample's keys only; rows come back in query order."""
    samples = torch.unique(queries.segments)
    if samples.numel() == 1 and bool((keys.segments == samples[0]).all()):
        return sdpa_attention(q, k, v, _mask(queries, keys, q.device), scale)
    rows, outs = [], []
    for s in samples.tolist():
        q_rows = torch.nonzero(queries.segments == s).view(-1)
        k_rows = torch.nonzero(keys.segments == s).view(-1)
        mine = Tokens(queries.positions[q_rows], queries.segments[q_rows])
        theirs = Tokens(keys.positions[k_rows], keys.segments[k_rows])
        q_idx, k_idx = q_rows.to(q.device), k_rows.to(q.device)
        outs.append(sdpa_attention(q[q_idx], k[k_idx], v[k_idx], _mask(mine, theirs, q.device), scale))
        rows.append(q_idx)
    return torch.cat(outs)[torch.argsort(torch.cat(rows))]
