"""Differentiable collectives over a dynamic group: the only communication the attention variants use.

Each is an autograd Function whose backward is the adjoint collective (all-gather <-> reduce-scatter,
all-to-all <-> the reverse all-to-all, ring shift forward <-> ring shift backward), so gradients are exact
and every rank of the group runs the same collectives in the same order in both passes.
"""

from __future__ import annotations

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


class _RingShift(torch.autograd.Function):
    """Send to group rank r+1 and receive from r-1 (same shape everywhere); backward shifts the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return _shift(grad, ctx.group, -1), None


def _shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    rank, size = group.rank(), group.size()
    out = torch.empty_like(x)
    dest = dist.get_global_rank(group, (rank + step) % size)
    source = dist.get_global_rank(group, (rank - step) % size)
    ops = [dist.P2POp(dist.isend, x.contiguous(), dest, group=group), dist.P2POp(dist.irecv, out, source, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 (equal shards), reduce-scatter of the gradient."""
    return _AllGather.apply(x, group)


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Flat all-to-all with uneven splits (element counts per peer), differentiable."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)


def ring_shift(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Pass `x` one step around the group's ring (r -> r+1), differentiable."""
    return _RingShift.apply(x, group)
