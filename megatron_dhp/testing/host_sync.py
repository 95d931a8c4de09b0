"""A dispatch mode that refuses what would make a GPU wait for the host, so a CPU run proves a GPU property.

On a GPU a layer must only enqueue kernels: reading a device value on the host (`item`, `tolist`,
`int(tensor)`, `bool(tensor)`: `aten._local_scalar_dense`), an operator whose output shape depends on the
data (`nonzero`, `unique`, `masked_select`, a boolean index, `repeat_interleave` without `output_size`), a
tensor made from host data (`torch.tensor(list)`: `aten.lift_fresh`) or a copy between devices each stalls
the stream. A CPU run cannot feel any of these, but it dispatches the same operators: `NoHostSync` raises at
the first one, naming it. `tolist` on a CPU tensor never reaches the dispatcher, so the mode also refuses
`Tensor.tolist` itself while active. `OpCount` counts the operators a block issues. What runs inside torch's
own kernels is not the caller's code: a higher-order operator passes through both modes as one operation,
and `opaque` wraps a function to run with no mode at all (FlexAttention's eager path compiles itself, which
any dispatch mode forbids).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten

SYNCING = {
    aten._local_scalar_dense.default: "reads a device value on the host (item, tolist, int or bool of a tensor)",
    aten.nonzero.default: "has a data-dependent shape (nonzero)",
    aten._unique2.default: "has a data-dependent shape (unique)",
    aten.unique_dim.default: "has a data-dependent shape (unique)",
    aten.unique_consecutive.default: "has a data-dependent shape (unique_consecutive)",
    aten.masked_select.default: "has a data-dependent shape (masked_select)",
}


class HostSyncError(AssertionError):
    """An operation that would synchronise a GPU with the host ran where none may."""


class NoHostSync(TorchDispatchMode):
    """Raise `HostSyncError` at any operation in `SYNCING`, a boolean index, `repeat_interleave` without
    `output_size`, a copy between devices, or `Tensor.tolist` (see the module docstring). Given a list `found`,
    append each such operation to it and run it instead: ranks that run collectives between their watched
    blocks then stay in step, and each reports what it found."""

    supports_higher_order_operators = True

    def __init__(self, found: list[str] | None = None) -> None:
        super().__init__()
        self.found = found

    def __enter__(self) -> NoHostSync:
        self._tolist = tolist = torch.Tensor.tolist

        def refuse_tolist(tensor: torch.Tensor) -> list:
            self._refuse("Tensor.tolist reads a device tensor on the host")
            return tolist(tensor)

        torch.Tensor.tolist = refuse_tolist
        return super().__enter__()

    def _refuse(self, what: str) -> None:
        if self.found is None:
            raise HostSyncError(what)
        self.found.append(what)

    def __exit__(self, *exc) -> None:
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return _opaque(func, args, kwargs)
        why = SYNCING.get(func) or _data_dependent(func, args, kwargs)
        if why is not None:
            self._refuse(f"{func} {why}")
        return func(*args, **kwargs)


def opaque(fn: Callable) -> Callable:
    """`fn` run with every dispatch mode switched off: a kernel of torch's that the modes cannot look inside."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return _opaque(fn, args, kwargs)

    return run


def _opaque(func: Callable, args: tuple, kwargs: dict):
    """Run a higher-order operator with no mode active (torch compiles its eager body, which a mode forbids)."""
    with _disable_current_modes():
        return func(*args, **kwargs)


def _data_dependent(func, args: tuple, kwargs: dict) -> str | None:
    if func is aten.lift_fresh.default and args[0].dim() > 0:  # a 0-dim constant goes to a kernel by value
        return "copies host data to the device (torch.tensor of Python values)"
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            return "indexes with a boolean mask (a data-dependent shape)"
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and kwargs.get("output_size") is None:
        return "has a data-dependent shape (repeat_interleave without output_size)"
    if func in (aten._to_copy.default, aten.copy_.default):
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if "device" in kwargs and kwargs["device"] is not None:
            devices.add(torch.device(kwargs["device"]))
        if len(devices) > 1:
            return f"copies between devices ({', '.join(sorted(map(str, devices)))})"
    return None


class OpCount(TorchDispatchMode):
    """Counts the aten operators issued while active (`counts`, `total`)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.counts[str(func)] += 1
        if isinstance(func, HigherOrderOperator):
            return _opaque(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:  # noqa: D102
        return sum(self.counts.values())
