"""The `sdpa` kernel: torch's fused attention sample by sample, the CPU's backend (and any device's fallback).

Each sample is one call on slices whose bounds are host ints of the microbatch's `AttentionMeta`, so a packed
microbatch costs sum L^2 like a varlen kernel, not (sum L)^2, and a layer reads no tensor on the host. Causal
samples and ring steps need no mask at all: a sample's shard is in position order (causal top-left), and a
ring step's block is, per sample, causal, a full front chunk or full back-chunk queries (`meta.RING_BLOCKS`).
Only the all-gather's runs see a bottom-right causal window over their sample's prefix, made on the device per
query block of `QUERY_BLOCK` rows (with a mask CPU SDPA materialises the scores; blocks keep them in cache).
Ring steps go through the device's fused kernel that returns the log-sum-exp and takes it back in backward
(CPU flash attention, CUDA memory-efficient attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_dhp.runtime.attention.math import (
    MASKED,
    accumulation_dtype,
    expand_kv_heads,
    sum_kv_heads,
    widened,
)
from megatron_dhp.runtime.attention.meta import (
    BACK_QUERIES,
    DIAGONAL,
    FRONT_KEYS,
    AttentionMeta,
    RingBlock,
    Spans,
)

QUERY_BLOCK = 256
"""Queries per masked SDPA call (the all-gather's runs): with a mask CPU SDPA materialises [heads, queries,
keys] scores, and blocks keep them in cache (for 512 queries over 1024 keys the softmax backward took 7x as
long as for 512 over 512, instead of 2x)."""


class SdpaKernel:
    """torch SDPA per sample (see the module docstring)."""

    def applies(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:  # noqa: D102
        return None

    def causal(self, q, k, v, spans: Spans, scale: float) -> torch.Tensor:  # noqa: D102
        h = q.shape[1]
        outs = [_sdpa(q[s], expand_kv_heads(k[s], h), expand_kv_heads(v[s], h), scale, causal=True)
                for s in spans.slices()]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def gathered(self, q, k, v, meta: AttentionMeta, scale: float) -> torch.Tensor:  # noqa: D102
        h = q.shape[1]
        k, v = (expand_kv_heads(meta.zigzag.unpack(x), h) for x in (k, v))
        outs = []
        runs = meta.runs
        for row, count, key_start, seen in zip(runs.queries.starts, runs.queries.lengths, runs.key_starts,
                                               runs.firsts):  # seen: the run's first position
            for b in range(0, count, QUERY_BLOCK):
                rows = min(QUERY_BLOCK, count - b)
                keys = slice(key_start, key_start + seen + b + rows)
                window = torch.ones(rows, keys.stop - keys.start, dtype=torch.bool, device=q.device).tril(seen + b)
                outs.append(_sdpa(q[row + b:row + b + rows], k[keys], v[keys], scale, mask=window))
        return torch.cat(outs)

    def block(self, q, k, v, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        h, dv = q.shape[1], v.shape[-1]
        out = q.new_zeros(q.shape[0], h, max(dv, q.shape[-1]))
        lse = torch.full((q.shape[0], h), MASKED, dtype=accumulation_dtype(q.dtype), device=q.device)
        v = widened(v, q.shape[-1])
        for rows, cols in block_slices(block, meta):
            o, s = _lse_forward(*_heads_first(q[rows], k[cols], v[cols], h), scale, block.kind == DIAGONAL)
            out[rows], lse[rows] = o.transpose(0, 1), s.transpose(0, 1)
        return out[..., :dv], lse

    def block_backward(self, grad, q, k, v, out, lse, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        acc, h, hk, dv = accumulation_dtype(q.dtype), q.shape[1], k.shape[1], v.shape[-1]
        grad, v, out = (widened(x, q.shape[-1]) for x in (grad, v, out))
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk, dvv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (k, v))
        for rows, cols in block_slices(block, meta):
            qh, kh, vh = _heads_first(q[rows], k[cols], v[cols], h)
            gq, gk, gv = _lse_backward(grad[rows].transpose(0, 1), qh, kh, vh, out[rows].transpose(0, 1),
                                       lse[rows].transpose(0, 1), scale, block.kind == DIAGONAL)
            dq[rows] = gq.transpose(0, 1)
            dk[cols] += sum_kv_heads(gk.transpose(0, 1).to(acc), hk)
            dvv[cols] += sum_kv_heads(gv.transpose(0, 1).to(acc), hk)
        return dq, dk, dvv[..., :dv]


def block_slices(block: RingBlock, meta: AttentionMeta) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each sample in ring step `block` (host ints, cached per microbatch): the queries
    in this rank's shard, the keys in the source's."""
    key = f"slices-{block.name}"
    if key not in meta.cache:
        pairs = []
        keys = block.keys.spans
        for a, n, b, m in zip(meta.local.starts, meta.local.lengths, keys.starts, keys.lengths):
            queries, back = slice(a, a + n), slice(a + n // 2, a + n)
            pairs.append({DIAGONAL: (queries, queries), FRONT_KEYS: (queries, slice(b, b + m // 2)),
                          BACK_QUERIES: (back, slice(b, b + m))}[block.kind])
        meta.cache[key] = pairs
    return meta.cache[key]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool = False,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    """[n, h, d] SDPA (kv heads already repeated) back in token-major order."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         is_causal=causal, scale=scale)
    return out.transpose(0, 1)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    return tuple(expand_kv_heads(x, heads).transpose(0, 1).contiguous() for x in (q, k, v))


def _lse_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads-first [h, n, d] attention and its log-sum-exp [h, n] through the device's fused kernel."""
    if q.is_cuda:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q[None], k[None], v[None], None, True, 0.0, causal, scale=scale)
        return out[0], lse[0, :, : q.shape[1]]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], 0.0, causal,
                                                                          scale=scale)
    return out[0], lse[0]


def _lse_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (heads-first) of `_lse_forward` given the merged output and log-sum-exp."""
    grad, out, lse = grad.to(q.dtype).contiguous(), out.to(q.dtype).contiguous(), lse.contiguous()
    if q.is_cuda:
        rows = q.shape[1]
        padded = lse.new_zeros(1, lse.shape[0], -(-rows // 32) * 32)  # the forward pads the lse to 32 rows
        padded[0, :, :rows] = lse
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # unused without dropout
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad[None], q[None], k[None], v[None], None, out[None], padded, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq[0], dk[0], dv[0]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad[None], q[None], k[None], v[None], out[None], lse[None], 0.0, causal, scale=scale)
    return dq[0], dk[0], dv[0]
