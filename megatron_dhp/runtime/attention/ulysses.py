"""Ulysses (all-to-all) context parallelism: trade the sequence split for a head split and back.

An all-to-all gives every rank all of the group's tokens for a subset of heads; attention is then local
over whole samples, and a second all-to-all returns the outputs to the token owners. Heads need not divide
the group: rank j gets h // d heads plus one if j < h % d (possibly zero). With GQA, key/value heads go
with their query heads when both counts divide the group; otherwise K/V are first repeated to one head per
query head (more traffic, same math) so any split stays exact. Under uneven shards the ranks hold different
numbers of tokens; the all-to-alls' splits come from the layout (`MicrobatchLayout.rank_slots`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dhp.runtime.attention.comm import all_to_all
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.kernels import LocalKernel
from megatron_dhp.runtime.attention.math import expand_kv_heads


def head_split(num_heads: int, size: int) -> list[int]:
    """Heads per group rank: as even as possible, the first `num_heads % size` ranks take one more."""
    return [num_heads // size + (j < num_heads % size) for j in range(size)]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, kernel: LocalKernel,
                      scale: float) -> torch.Tensor:
    """Causal attention with heads scattered and the sequence gathered over the group; [t, h, dh] in and out.
    After the all-to-all the group's rows are put in position order (`zigzag_unpack`), so every kernel sees
    whole samples; a rank left without heads attends nothing."""
    meta, group = ctx.meta, ctx.group
    size, heads, kv_heads = ctx.layout.group_size, q.shape[1], k.shape[1]
    if heads % size or kv_heads % size:
        k, v = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    q_split, kv_split = head_split(heads, size), head_split(k.shape[1], size)
    rows = ctx.layout.rank_slots
    q, k, v = (meta.zigzag.unpack(_scatter_heads(x, split, rows, group))
               for x, split in ((q, q_split), (k, kv_split), (v, kv_split)))
    out = kernel.causal(q, k, v, meta.natural, scale) if q.shape[1] else no_heads(q, k, v)
    return _gather_heads(meta.zigzag.pack(out), q_split, rows, group)


def no_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The [t, 0, dv] output of a rank with no heads, still a function of q, k, v so that their (empty)
    gradients flow back through the all-to-alls every rank of the group runs."""
    return (q[..., :1] + k.sum() + v.sum()).expand(q.shape[0], 0, v.shape[-1]) * 0


def _scatter_heads(x: torch.Tensor, split: list[int], rows: tuple[int, ...], group: dist.ProcessGroup
                   ) -> torch.Tensor:
    """[t, h, dh] local tokens, all heads -> [sum rows, h_r, dh] all tokens (rank-major), this rank's heads;
    `rows`: every group rank's tokens (the layout's `rank_slots`), so each split is known without a message."""
    t, _, dh = x.shape
    rank = group.rank()
    send = torch.cat([part.reshape(-1) for part in torch.split(x, split, dim=1)])
    out = all_to_all(send, [t * n * dh for n in split], [m * split[rank] * dh for m in rows], group)
    return out.view(sum(rows), split[rank], dh)


def _gather_heads(x: torch.Tensor, split: list[int], rows: tuple[int, ...], group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `_scatter_heads`: [sum rows, h_r, dh] -> [t, h, dh]."""
    rank = group.rank()
    t, dh = rows[rank], x.shape[2]
    out = all_to_all(x.reshape(-1), [m * split[rank] * dh for m in rows], [t * n * dh for n in split], group)
    parts = torch.split(out, [t * n * dh for n in split])
    return torch.cat([p.view(t, n, dh) for p, n in zip(parts, split)], dim=1)
