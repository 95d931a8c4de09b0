"""How the tests compare floating-point results: relative to the scale of the values compared.

fp32 rounds a value near x to ~6e-8 x, and how often depends on the GEMM shapes, the CPU's kernels
(ATEN_CPU_CAPABILITY) and the thread count: an absolute bound below the values' own rounding fails on some
machine. So every comparison here divides the largest difference by the largest reference value, and a
property that must be exact is computed in fp64 or on integers (`scripts/numerics_check.sh` runs the tests
that compare under each kernel set and thread count).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_dhp.verify.selfcheck import CheckResult, SelfCheck

RELATIVE = 1e-5
"""The project's promise, loss and every gradient equal to one process at fp32 1e-5, read relative to the
oracle's largest value: 80-170 ulps of it. The checks here measure up to 5.5e-7 (a few ulps: each GEMM of
depth K may round by up to K, a few in practice); a fault moves them by 1e-3 or more (mis-sized shares: 3.8e-3
on the loss, 0.38 on the gradients)."""

TINY = torch.finfo(torch.float32).tiny
"""The smallest scale divided by: an all-zero reference compares `got` against 0 instead of dividing by 0."""


def relative(diff: float, scale: float) -> float:
    """`diff` on the scale `scale` (a largest |reference value|)."""
    return diff / max(abs(scale), TINY)


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in fp64 on the CPU."""
    want = want.detach().double().cpu()
    return relative(float((got.detach().double().cpu() - want).abs().max()), float(want.abs().max()))


def largest_abs(tensors) -> float:
    """The largest |value| of any of `tensors` (None entries skipped): a set of gradients' scale."""
    return max((float(t.detach().abs().max()) for t in tensors if t is not None and t.numel()), default=0.0)


class RelativeSelfCheck(SelfCheck):
    """`SelfCheck` whose results hold their differences relative to the oracle's scale: `max_loss_diff` is
    |loss - oracle| / |oracle loss|, `max_grad_diff` the largest gradient difference over the oracle's largest
    gradient element (every parameter's, the same on every rank). Its `ok` then reads `RELATIVE` (the library's
    `TOLERANCE` is the same 1e-5)."""

    def check(self, *args, **kwargs) -> CheckResult:
        result = super().check(*args, **kwargs)
        grad_scale = largest_abs(p.grad for p in self.reference.parameters())  # the oracle's step just ran
        return replace(result, max_loss_diff=relative(result.max_loss_diff, result.reference_loss),
                       max_grad_diff=relative(result.max_grad_diff, grad_scale))
