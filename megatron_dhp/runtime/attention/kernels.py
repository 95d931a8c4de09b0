"""Local attention kernels behind one protocol, and the rule that picks one (`resolve`).

Every communication variant reduces to three local questions, each answered from the microbatch's
`AttentionMeta` with no host work per layer:

- `causal`: causal attention within each of a set of packed samples (a one-rank group's shards; Ulysses'
  whole samples after the all-to-all);
- `gathered`: this rank's zigzag shards as queries over the group's gathered keys (all-gather);
- `block` / `block_backward`: one ring step (`meta.RING_BLOCKS`): output and log-sum-exp, and the step's
  gradients recomputed from the *merged* output and log-sum-exp, as flash attention's backward does.

Backends (`kernel(name)`): `math` (explicit fp32 scores, the oracle), `sdpa` (torch's fused kernels sample by
sample: the CPU's), `varlen` (torch's flash-attention varlen kernels, CUDA, bf16/fp16), `flex`
(FlexAttention: one block mask per microbatch and ring step; compiled by Triton on a GPU, forward only on a
CPU) and `flash` (flash-attn's varlen kernel for whole samples; its ring steps take torch's flash kernels,
the same algorithm). `auto` resolves by device and dtype, never silently: `describe` is the start-up line.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention.meta import AttentionMeta, RingBlock, Spans


class LocalKernel(Protocol):
    """A local attention backend. q [t, h, dk], k [t, hk, dk], v [t, hk, dv] (GQA: h a multiple of hk; MLA:
    dv <= dk); outputs [t, h, dv]; log-sum-exps [t, h] in fp32 (fp64 for fp64)."""

    def applies(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
        """None when this kernel runs on tensors of this device type, dtype and query head size, else why not."""
        ...

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans, scale: float) -> torch.Tensor:
        """Causal attention within each sample of `spans` (rows in position order); differentiable."""
        ...

    def gathered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, scale: float
                 ) -> torch.Tensor:
        """This rank's rows as queries over every group rank's rows (rank-major) as keys; differentiable."""
        ...

    def block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: RingBlock, meta: AttentionMeta,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One ring step (`block`: its kind and the rows of k and v): output (zero where a query sees nothing) and
        log-sum-exp (`MASKED` there), not differentiable."""
        ...

    def block_backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, block: RingBlock, meta: AttentionMeta, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv (fp32, kv heads) of one ring step from the merged output and log-sum-exp of the forward."""
        ...


@functools.cache
def _kernels() -> dict[str, LocalKernel]:
    """Name -> kernel, imported on first use (flex and flash-attn import nothing until then)."""
    from megatron_dhp.runtime.attention.flash import FlashAttnKernel
    from megatron_dhp.runtime.attention.flex import FlexKernel
    from megatron_dhp.runtime.attention.oracle import MathKernel
    from megatron_dhp.runtime.attention.sdpa import SdpaKernel
    from megatron_dhp.runtime.attention.varlen import VarlenKernel

    return {"math": MathKernel(), "sdpa": SdpaKernel(), "varlen": VarlenKernel(), "flex": FlexKernel(),
            "flash": FlashAttnKernel()}


AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("varlen", "flex", "sdpa"), "cpu": ("sdpa",)}
"""What `auto` tries, first that applies wins. On a GPU: torch's varlen flash kernels (bf16/fp16), else
FlexAttention (fp32, head sizes flash attention lacks), else sdpa. On a CPU: sdpa (flex has no CPU backward)."""


def kernel(name: str) -> LocalKernel:
    """The kernel registered as `name` (not `auto`)."""
    kernels = _kernels()
    if name not in kernels:
        raise DhpError(f"attention backend {name!r} is unknown; use auto or one of {', '.join(kernels)}")
    return kernels[name]


def resolve(name: str, q: torch.Tensor) -> LocalKernel:
    """The kernel `name` picks for `q` (pure host checks, no tensor read): `auto` by `AUTO_ORDER`, a named
    one if it applies, else a `DhpError` saying why and what to use."""
    if name == "auto":
        return kernel(resolve_name(q.device.type, q.dtype, q.shape[-1]))
    chosen = kernel(name)
    why = chosen.applies(q.device.type, q.dtype, q.shape[-1])
    if why is not None:
        raise DhpError(f"attention backend {name!r} cannot run here: {why}; set attention_backend: auto")
    return chosen


@functools.cache
def resolve_name(device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """`auto`'s choice for tensors of this device type, dtype and head size."""
    for name in AUTO_ORDER.get(device_type, ("sdpa",)):
        if kernel(name).applies(device_type, dtype, head_dim) is None:
            return name
    return "sdpa"


def describe(name: str, device: torch.device | str, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
             head_dim: int = 128) -> str:
    """The start-up line's account of the backend: what `name` runs on `device` for each dtype."""
    device_type = torch.device(device).type
    if name != "auto":
        return f"attention backend {name}"
    picks = ", ".join(f"{str(d).removeprefix('torch.')} -> {resolve_name(device_type, d, head_dim)}" for d in dtypes)
    return f"attention backend auto on {device_type}: {picks} (every comm variant)"
