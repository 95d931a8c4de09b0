"""Attention math and kernels against a dense per-sample causal reference (no process group)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dhp.runtime.attention.math import block_attention, merge_partials, visible
from megatron_dhp.runtime.attention.ulysses import head_split


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
    # fp64 on N(0, 1) inputs, outputs below 3: 1e-12 is ~2,000 ulps of them (4e-16 measured), a wrong mask O(1)
    torch.testing.assert_close(out, dense_reference(q, k, v, pos, seg, scale), rtol=0, atol=1e-12)
    assert lse.shape == (t, heads)


def test_merge_of_key_blocks_equals_full_attention_including_empty_rows():
    pos, seg = shuffled_tokens([6, 6], seed=2)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(12, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    full, _ = block_attention(q, k, v, visible(pos, pos, seg, seg), 0.5)
    blocks = [torch.arange(0, 4), torch.arange(4, 9), torch.arange(9, 12)]  # some queries see nothing in a block
    parts = [block_attention(q, k[b], v[b], visible(pos, pos[b], seg, seg[b]), 0.5) for b in blocks]
    merged = merge_partials([o for o, _ in parts], [lse for _, lse in parts])
    torch.testing.assert_close(merged, full, rtol=0, atol=1e-12)  # fp64, values below ~3: as above
    (grad_full,) = torch.autograd.grad(full.sum(), k)
    (grad_merged,) = torch.autograd.grad(merged.sum(), k)
    assert torch.isfinite(grad_merged).all()
    torch.testing.assert_close(grad_merged, grad_full, rtol=0, atol=1e-12)  # fp64, gradients below 1


def test_head_split_is_balanced_and_may_leave_ranks_without_heads():
    assert head_split(4, 3) == [2, 1, 1]
    assert head_split(2, 4) == [1, 1, 0, 0]
    assert head_split(8, 4) == [2, 2, 2, 2]
