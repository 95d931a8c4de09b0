"""What the ring-attention tests run on every spawned gloo rank: exactness against one process, saved bytes.

Each launch serves every group size at once through subgroups of the first d ranks, so the tests pay one
process start-up each.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_dhp.runtime.attention.comm import PeerRing
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.core_attention import dynamic_cp_attention
from megatron_dhp.runtime.fused import zigzag_pack
from megatron_dhp.runtime.layout import MicrobatchLayout
from tests.numerics import relative_diff
from tests.ranks import start_gloo_rank

HEAD_DIM = 8


def _groups(sizes: tuple[int, ...]) -> Iterator[tuple[int, dist.ProcessGroup]]:
    """(d, the group of ranks 0..d-1) for each d this rank belongs to; every rank creates every group."""
    start_gloo_rank()
    groups = [(d, dist.new_group(list(range(d)))) for d in sizes]
    for d, group in groups:
        if dist.get_rank() < d:
            yield d, group


def ring_against_one_process(lengths: tuple[int, ...], heads: int, kv_heads: int, v_dim: int = HEAD_DIM,
                             comms: tuple[str, ...] = ("ring", "p2p")) -> dict:
    """Per (group size, backend, variant): output and q/k/v gradients on this rank's shards against one
    process's, relative to their largest value (values `v_dim` wide, MLA's narrower V when below HEAD_DIM)."""
    whole = MicrobatchLayout(tuple(range(len(lengths))), lengths, 1, 0)
    gen = torch.Generator().manual_seed(0)  # the same whole tensors on every rank
    q, k, v, w = (torch.randn(sum(lengths), n, dim, generator=gen)
                  for n, dim in ((heads, HEAD_DIM), (kv_heads, HEAD_DIM), (kv_heads, v_dim), (heads, v_dim)))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = dynamic_cp_attention(*leaves, CPContext(whole, None, backend="math"), 0.3)
    want = [out, *torch.autograd.grad((out * w).sum(), leaves)]
    diffs = {}
    for size, group in _groups((2, 3)):
        layout = MicrobatchLayout(whole.sample_ids, lengths, size, group.rank())

        def shard(x: torch.Tensor, layout: MicrobatchLayout = layout) -> torch.Tensor:
            return zigzag_pack(x, layout.cu_seqlens, layout.group_size, layout.rank)

        # p2p: the same ring with its members addressed by global rank on the world's communicator
        peers = {"p2p": PeerRing(tuple(range(size)), group.rank(), None)}
        for comm, backend in itertools.product(comms, ("sdpa", "math")):
            ring = peers.get(comm, group)
            shards = [shard(x).requires_grad_() for x in (q, k, v)]
            out = dynamic_cp_attention(*shards, CPContext(layout, ring, comm, backend), 0.3)
            got = [out, *torch.autograd.grad((out * shard(w)).sum(), shards)]
            real = layout.real()
            diffs[size, backend, comm] = [relative_diff(y[real], shard(x)[real]) for x, y in zip(want, got)]
    return diffs


def saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes autograd keeps for backward after `fn()`: the sum of the unique storages it saved."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def saved_bytes_per_rank(tokens_per_rank: int, heads: int) -> dict[tuple[int, str], int]:
    """Per (group size, variant): bytes saved for backward by one forward on one sample of d x tokens_per_rank."""
    out = {}
    for size, group in _groups((1, 2, 3, 4)):
        layout = MicrobatchLayout((0,), (tokens_per_rank * size,), size, group.rank())
        assert layout.num_slots == tokens_per_rank
        q, k, v = (torch.randn(tokens_per_rank, heads, HEAD_DIM, requires_grad=True) for _ in range(3))
        for comm in ("allgather", "ring"):
            ctx = CPContext(layout, group, comm, "sdpa")
            out[size, comm] = saved_bytes(lambda: dynamic_cp_attention(q, k, v, ctx, 0.25))  # noqa: B023 - called at once
    return out
