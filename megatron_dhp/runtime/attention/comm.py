"""Differentiable collectives over a dynamic group: the only communication the attention variants use.

Each is an autograd Function whose backward is the adjoint collective (all-gather <-> reduce-scatter,
all-to-all <-> the reverse all-to-all), so gradients are exact and every rank of the group runs the same
collectives in the same order in both passes. The ring's point-to-point shift is the exception: the ring
attention's own backward decides what travels (K/V with their gradients), so the shift is a plain one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def start_shift(x: torch.Tensor, group: dist.ProcessGroup | None, tag: int = 0) -> Shift:
    """Send `x` to group rank r+1 and receive the same shape from r-1, without waiting (not differentiable).

    The ring attention overlaps these with compute and differentiates them by hand; `tag` keeps two shifts in
    flight between the same ranks apart. A ring of one rank (`group` None or of size 1) hands `x` back.
    """
    if group is None or group.size() == 1:
        return Shift([], x, x)
    rank, size = group.rank(), group.size()
    x, out = x.contiguous(), torch.empty_like(x)
    dest, source = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    ops = [dist.P2POp(dist.isend, x, dest, group=group, tag=tag), dist.P2POp(dist.irecv, out, source, group=group, tag=tag)]
    return Shift(dist.batch_isend_irecv(ops), x, out)


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 (equal shards), reduce-scatter of the gradient."""
    return _AllGather.apply(x, group)


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Flat all-to-all with uneven splits (element counts per peer), differentiable."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)
