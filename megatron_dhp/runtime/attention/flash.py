"""flash-attn varlen on the dynamic-CP layout (CUDA only; imported lazily, absent on CPU machines).

Keys that are whole samples in group order are every rank's zigzag shards of the padded samples, one rank
after another; `fused.zigzag_unpack` puts them back into natural order, so each sample is one causal varlen
sequence. Queries that are whole samples too (Ulysses) take the same reordering and `zigzag_pack` returns
their outputs; a rank's own zigzag shards (all-gather) are runs of consecutive positions, and a run
starting at position a attends the first a + len keys of its sample, which flash's bottom-right-aligned
causal mask expresses directly.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_dhp.runtime.attention.math import widened
from megatron_dhp.runtime.attention.tokens import Tokens
from megatron_dhp.runtime.fused import gather_rows, zigzag_pack, zigzag_unpack
from megatron_dhp.runtime.layout import MicrobatchLayout


def _varlen_kernel() -> Any | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def usable(q: torch.Tensor) -> bool:
    """Whether flash-attn can run on `q`: installed, CUDA tensor, half precision, at least one head."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[1] > 0 and _varlen_kernel() is not None


def query_runs(positions: torch.Tensor, segments: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Maximal runs of consecutive positions within one sample: (row start, length, sample, first position)."""
    pos, seg = positions.tolist(), segments.tolist()
    runs: list[tuple[int, int, int, int]] = []
    for i, (p, s) in enumerate(zip(pos, seg)):
        if runs and s == runs[-1][2] and p == runs[-1][3] + runs[-1][1]:
            start, length, sample, first = runs[-1]
            runs[-1] = (start, length + 1, sample, first)
        else:
            runs.append((i, 1, s, p))
    return runs


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    queries: Tokens,
    layout: MicrobatchLayout,
    scale: float,
    kernel: Any | None = None,
) -> torch.Tensor:
    """Causal attention with keys = every slot of `layout` in group order; `kernel` defaults to flash-attn.
    flash-attn takes one head size: MLA's narrower V runs `widened` with zero columns, cut off after."""
    kernel = kernel or _varlen_kernel()
    device, dv, v = q.device, v.shape[-1], widened(v, q.shape[-1])
    # the group's slots are the zigzag shards of the padded samples, which need no further padding
    padded, size = layout.cu_seqlens_padded, layout.group_size
    k_nat, v_nat = zigzag_unpack(k, padded, size, None), zigzag_unpack(v, padded, size, None)
    cu_k = padded.to(device)
    if queries.whole_samples is layout:
        out_nat = kernel(
            zigzag_unpack(q, padded, size, None), k_nat, v_nat, cu_k, cu_k, layout.max_seqlen, layout.max_seqlen,
            softmax_scale=scale, causal=True,
        )
        return zigzag_pack(out_nat, padded, size, None)[..., :dv]
    runs = query_runs(queries.positions, queries.segments)
    starts = padded.tolist()
    kv_index = torch.cat([torch.arange(starts[s], starts[s] + p0 + n) for _, n, s, p0 in runs]).to(device)
    cu_q = _cumsum([n for _, n, _, _ in runs], device)
    cu_kv = _cumsum([p0 + n for _, n, _, p0 in runs], device)
    return kernel(
        q, gather_rows(k_nat, kv_index), gather_rows(v_nat, kv_index), cu_q, cu_kv,
        max(n for _, n, _, _ in runs), max(p0 + n for _, n, _, p0 in runs), softmax_scale=scale, causal=True,
    )[..., :dv]


def _cumsum(values: list[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(values) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(values), 0)
    return out.to(device)
