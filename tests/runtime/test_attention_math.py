"""Attention math and kernels against a dense per-sample causal reference (no process group)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dhp.runtime.attention import flash
from megatron_dhp.runtime.attention.kernels import attend
from megatron_dhp.runtime.attention.math import block_attention, merge_partials, visible
from megatron_dhp.runtime.attention.tokens import Tokens
from megatron_dhp.runtime.attention.ulysses import head_split
from megatron_dhp.runtime.layout import MicrobatchLayout


def dense_reference(q, k, v, positions, segments, scale):
    """Plain softmax attention per sample, query by query, over keys at positions <= its own."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        keys = [j for j in range(k.shape[0]) if segments[j] == segments[i] and positions[j] <= positions[i]]
        for h in range(q.shape[1]):
            scores = torch.stack([q[i, h] @ k[j, h // group] * scale for j in keys])
            weights = torch.softmax(scores, 0)
            out[i, h] = sum(w * v[j, h // group] for w, j in zip(weights, keys))
    return out


def shuffled_tokens(lengths, seed):
    """Tokens of several samples in a scrambled order, as a gathered zigzag layout would hold them."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.arange(n) for n in lengths])
    segments = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)])
    order = torch.randperm(positions.numel(), generator=gen)
    return positions[order], segments[order]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_block_attention_matches_dense_reference(heads, kv_heads):
    pos, seg = shuffled_tokens([5, 1, 7], seed=heads)
    t, dh = pos.numel(), 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, n, dh, generator=gen, dtype=torch.float64) for n in (heads, kv_heads, kv_heads))
    scale = 1 / math.sqrt(dh)
    out, lse = block_attention(q, k, v, visible(pos, pos, seg, seg), scale)
    torch.testing.assert_close(out, dense_reference(q, k, v, pos, seg, scale), rtol=0, atol=1e-12)
    assert lse.shape == (t, heads)


def test_sdpa_and_math_kernels_agree():
    pos, seg = shuffled_tokens([9, 4], seed=1)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(pos.numel(), n, 4, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    tokens = Tokens(pos, seg)
    torch.testing.assert_close(attend(q, k, v, tokens, tokens, 0.5, "sdpa"), attend(q, k, v, tokens, tokens, 0.5, "math"))


def test_sdpa_in_query_blocks_equals_math_in_values_and_gradients(monkeypatch):
    from megatron_dhp.runtime.attention import math as attention_math

    monkeypatch.setattr(attention_math, "SDPA_QUERY_BLOCK", 7)  # 40 queries of a sample: 6 blocks, the last short
    pos, seg = shuffled_tokens([40, 3], seed=2)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(pos.numel(), n, 4, generator=gen, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    tokens = Tokens(pos, seg)
    weights = torch.randn(pos.numel(), 4, 4, generator=gen, dtype=torch.float64)
    grads = []
    for backend in ("sdpa", "math"):
        out = attend(q, k, v, tokens, tokens, 0.5, backend)
        grads.append((out, *torch.autograd.grad((out * weights).sum(), (q, k, v))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_merge_of_key_blocks_equals_full_attention_including_empty_rows():
    pos, seg = shuffled_tokens([6, 6], seed=2)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(12, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    full, _ = block_attention(q, k, v, visible(pos, pos, seg, seg), 0.5)
    blocks = [torch.arange(0, 4), torch.arange(4, 9), torch.arange(9, 12)]  # some queries see nothing in a block
    parts = [block_attention(q, k[b], v[b], visible(pos, pos[b], seg, seg[b]), 0.5) for b in blocks]
    merged = merge_partials([o for o, _ in parts], [lse for _, lse in parts])
    torch.testing.assert_close(merged, full, rtol=0, atol=1e-12)
    (grad_full,) = torch.autograd.grad(full.sum(), k)
    (grad_merged,) = torch.autograd.grad(merged.sum(), k)
    assert torch.isfinite(grad_merged).all()
    torch.testing.assert_close(grad_merged, grad_full, rtol=0, atol=1e-12)


def test_head_split_is_balanced_and_may_leave_ranks_without_heads():
    assert head_split(4, 3) == [2, 1, 1]
    assert head_split(2, 4) == [1, 1, 0, 0]
    assert head_split(8, 4) == [2, 2, 2, 2]


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """flash-attn's varlen contract on CPU: per sequence, causal aligned to the bottom-right corner."""
    assert causal
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        assert nq <= max_q and nk <= max_k
        scores = torch.einsum("qhd,khd->hqk", q[qs], kk[ks]) * softmax_scale
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        out[qs] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), vv[ks])
    return out


@pytest.mark.parametrize("rank", [0, 2])
def test_flash_reordering_matches_math(rank):
    """The varlen decomposition (own zigzag shards, and whole gathered samples) with a CPU stand-in kernel."""
    layout = MicrobatchLayout(sample_ids=(0, 1), lengths=(11, 5), group_size=3, rank=rank)
    gen = torch.Generator().manual_seed(3)
    n_all = layout.group_positions.numel()
    k, v = (torch.randn(n_all, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    keys = Tokens(layout.group_positions, layout.group_segments, whole_samples=layout)
    own = Tokens(layout.local_positions, layout.segments)
    q_own = torch.randn(layout.num_slots, 4, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        flash.attend(q_own, k, v, own, layout, 0.5, kernel=reference_varlen), attend(q_own, k, v, own, keys, 0.5, "math")
    )
    q_all = torch.randn(n_all, 4, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        flash.attend(q_all, k, v, keys, layout, 0.5, kernel=reference_varlen), attend(q_all, k, v, keys, keys, 0.5, "math")
    )


@pytest.mark.skipif(not torch.cuda.is_available() or flash._varlen_kernel() is None, reason="needs CUDA and flash-attn")
def test_flash_kernel_on_gpu_matches_math():
    layout = MicrobatchLayout(sample_ids=(0, 1), lengths=(70, 33), group_size=2, rank=1)
    keys = Tokens(layout.group_positions, layout.group_segments, whole_samples=layout)
    own = Tokens(layout.local_positions, layout.segments)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(layout.num_slots, 4, 64, generator=gen).cuda().bfloat16()
    k, v = (torch.randn(layout.group_positions.numel(), 2, 64, generator=gen).cuda().bfloat16() for _ in range(2))
    torch.testing.assert_close(
        attend(q, k, v, own, keys, 0.125, "flash").float(), attend(q, k, v, own, keys, 0.125, "math").float(), atol=2e-2, rtol=0
    )
