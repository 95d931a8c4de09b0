"""Differentiable collectives over a dynamic group: the only communication the attention variants use.

Each is an autograd Function whose backward is the adjoint collective (all-gather <-> reduce-scatter,
all-to-all <-> the reverse all-to-all), so gradients are exact and every rank of the group runs the same
collectives in the same order in both passes. The ring's point-to-point shift is the exception: the ring
attention's own backward decides what travels (K/V with their gradients), so the shift is a plain one, and
it runs over either a group's own communicator or a `PeerRing` on the domain's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_dhp.runtime.domain import DynamicDomain

# torch 2.13 renamed the flat collectives and deprecates the old names; older releases only have those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """Concatenate equal-sized shards along dim 0 in group-rank order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        group = ctx.group
        out = grad.new_empty((grad.shape[0] // group.size(), *grad.shape[1:]))
        reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=group)
        return out, None


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` on a flat tensor with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(  # noqa: D102
        ctx, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty(sum(recv_splits))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: D102
        out = grad.new_empty(sum(ctx.send_splits))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return out, None, None, None


@dataclass(frozen=True)
class PeerRing:
    """A group's members as peers on a communicator they share with every other group (the domain's).

    It answers what the ring and megatron's THD RoPE ask of a process group, `size()` and `rank()` (RoPE
    reads nothing else on megatron-core 0.16.1), and names the neighbours by global rank, which is what
    `dist.P2POp` takes whatever its group: a group then costs no communicator of its own.
    """

    members: tuple[int, ...]
    """Global ranks of the group, in group-rank order."""
    index: int
    """This rank's place in `members`."""
    group: dist.ProcessGroup | None
    """The communicator the traffic runs on (None: the default one)."""

    def __post_init__(self) -> None:
        assert 0 <= self.index < len(self.members), f"index {self.index} outside a ring of {len(self.members)}"

    def size(self) -> int:  # noqa: D102
        return len(self.members)

    def rank(self) -> int:  # noqa: D102
        return self.index

    @property
    def next(self) -> int:
        """Global rank of the member after this one (the ring sends to it)."""
        return self.members[(self.index + 1) % len(self.members)]

    @property
    def previous(self) -> int:
        """Global rank of the member before this one (the ring receives from it)."""
        return self.members[(self.index - 1) % len(self.members)]

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> PeerRing:
        """A process group's members on the group's own communicator."""
        return cls(tuple(dist.get_process_group_ranks(group)), group.rank(), group)

    @classmethod
    def in_domain(cls, domain: DynamicDomain, positions: Sequence[int]) -> PeerRing | None:
        """The group of sorted domain `positions` (this rank among them) on the domain's communicator; None
        for one rank, which communicates nothing."""
        if len(positions) == 1:
            return None
        return cls(tuple(domain.global_ranks[p] for p in positions), list(positions).index(domain.position), domain.group)


@dataclass
class Shift:
    """A ring shift in flight: `wait()` returns the tensor received from the rank behind."""

    works: list
    sent: torch.Tensor
    """Held until the shift completes."""
    received: torch.Tensor

    def wait(self) -> torch.Tensor:  # noqa: D102
        for work in self.works:
            work.wait()
        return self.received


def start_shift(x: torch.Tensor, ring: dist.ProcessGroup | PeerRing | None, tag: int = 0,
                rows: int | None = None) -> Shift:
    """Send `x` to group rank r+1 and receive from r-1, without waiting (not differentiable): `rows` rows of
    `x`'s other dimensions (default: `x`'s shape), a size the caller knows from the layout, never from a message.

    `ring` is a group's own process group or a `PeerRing` on a shared one. The ring attention overlaps these
    with compute and differentiates them by hand; `tag` keeps two shifts in flight between the same ranks
    apart. A ring of one rank (`ring` None or of size 1) hands `x` back.
    """
    if ring is None or ring.size() == 1:
        return Shift([], x, x)
    peers = ring if isinstance(ring, PeerRing) else PeerRing.of_group(ring)
    x = x.contiguous()
    out = torch.empty_like(x) if rows is None else x.new_empty((rows, *x.shape[1:]))
    ops = [dist.P2POp(dist.isend, x, peers.next, group=peers.group, tag=tag),
           dist.P2POp(dist.irecv, out, peers.previous, group=peers.group, tag=tag)]
    return Shift(dist.batch_isend_irecv(ops), x, out)


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 (equal shards), reduce-scatter of the gradient."""
    return _AllGather.apply(x, group)


def all_gather_padded(x: torch.Tensor, group: dist.ProcessGroup, width: int, keep: torch.Tensor) -> torch.Tensor:
    """`all_gather` of blocks of different sizes (uneven shards): each travels padded to `width` rows, the most
    any rank holds, and `keep` (the rows of the padded result that hold a rank's rows, on the device) strips the
    padding; autograd's adjoints of pad and strip wrap the reduce-scatter of the gradient the same way."""
    padded = torch.cat((x, x.new_zeros((width - x.shape[0], *x.shape[1:]))))
    return _AllGather.apply(padded, group).index_select(0, keep)


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Flat all-to-all with uneven splits (element counts per peer), differentiable."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)
