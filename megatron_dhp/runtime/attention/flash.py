"""The `flash` kernel: flash-attn's varlen kernel (the `flash-attn` package, CUDA, bf16/fp16), where installed.

It answers the whole-sample questions (`causal`, `gathered`) with flash-attn's own `flash_attn_varlen_func`
on the same inputs as `varlen` (imported lazily: absent on CPU machines); flash-attn >= 2.1, whose causal mask
is bottom-right aligned, as the all-gather's runs need. Ring steps need a kernel that takes the merged
log-sum-exp back, which torch's flash operators do (`varlen`, the same FlashAttention-2 algorithm).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_dhp.runtime.attention.math import widened
from megatron_dhp.runtime.attention.meta import AttentionMeta, Spans
from megatron_dhp.runtime.attention.varlen import VarlenKernel, flash_applies, run_key_index
from megatron_dhp.runtime.fused import gather_rows


def varlen_func() -> Any | None:
    """flash-attn's `flash_attn_varlen_func`, or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


FLASH_ATTN_FLOOR = "2.1"
"""The first flash-attn whose causal mask is bottom-right aligned: older ones align it top-left, silently wrong
for the all-gather's runs (queries that see more keys than themselves)."""


class FlashAttnKernel(VarlenKernel):
    """flash-attn for whole samples; ring steps as `varlen` (see the module docstring)."""

    def applies(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:  # noqa: D102
        if varlen_func() is None:
            return f"flash-attn is not installed (pip install 'flash-attn>={FLASH_ATTN_FLOOR}')"
        import flash_attn
        from packaging.version import Version

        if Version(flash_attn.__version__) < Version(FLASH_ATTN_FLOOR):
            return (f"flash-attn {flash_attn.__version__} is older than {FLASH_ATTN_FLOOR}, whose causal mask is "
                    f"bottom-right aligned as the all-gather's runs need (pip install 'flash-attn>={FLASH_ATTN_FLOOR}')")
        return flash_applies(device_type, dtype, head_dim)

    def causal(self, q, k, v, spans: Spans, scale: float) -> torch.Tensor:  # noqa: D102
        dv = v.shape[-1]
        return varlen_func()(q, k, widened(v, q.shape[-1]), spans.cu, spans.cu, spans.max_len, spans.max_len,
                             softmax_scale=scale, causal=True)[..., :dv]

    def gathered(self, q, k, v, meta: AttentionMeta, scale: float) -> torch.Tensor:  # noqa: D102
        dv = v.shape[-1]
        queries, keys = meta.runs.queries, meta.runs.keys
        k, v = (gather_rows(meta.zigzag.unpack(x), run_key_index(meta)) for x in (k, widened(v, q.shape[-1])))
        return varlen_func()(q, k, v, queries.cu, keys.cu, queries.max_len, keys.max_len, softmax_scale=scale,
                             causal=True)[..., :dv]
