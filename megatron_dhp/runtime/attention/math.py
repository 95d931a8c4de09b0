"""Causal attention over packed (THD) tokens addressed by (sample, position), and the log-sum-exp merge.

A query may see a key of the same sample at the same or an earlier position, wherever either token sits in
the tensors: the single source of truth for "causal" is the token's position in its sample. These pure
functions are what the `math` kernel (`oracle`) computes with and what every other kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Finite stand-in for -inf: a block with no visible key for some query (common in ring steps) then has a
# log-sum-exp of about -1e30 instead of -inf, whose merge weight is exactly 0 and whose gradient is not NaN.
MASKED = -1.0e30


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor) -> torch.Tensor:
    """[tq, tk] boolean: key j is in query i's sample at a position <= the query's."""
    return (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat GQA key/value heads so head i serves query head i (Megatron: query head i uses kv i // group)."""
    kv_heads = x.shape[1]
    if kv_heads == num_heads:
        return x
    assert kv_heads > 0 and num_heads % kv_heads == 0, f"{num_heads} query heads over {kv_heads} kv heads"
    return x.repeat_interleave(num_heads // kv_heads, dim=1)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries [tq, h, dh] over keys/values [tk, hk, dh] under `mask` [tq, tk].

    Returns the output [tq, h, dh] and the log-sum-exp [tq, h] of the scaled scores (fp32), so partial
    results over disjoint key blocks can be merged exactly with `merge_partials`. Half precision is
    accumulated in fp32.
    """
    h = q.shape[1]
    k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)
    acc = accumulation_dtype(q.dtype)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    scores = scores.masked_fill(~mask, MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, v.to(acc))
    return out.to(q.dtype), lse.transpose(0, 1)


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with a row that saw no key as `MASKED`, however its kernel wrote it: -inf from a masked softmax,
    +inf from flash attention's empty key range (either would make the merge's weights NaN)."""
    return torch.where(torch.isfinite(lse), lse, MASKED)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Combine attention over disjoint key blocks: softmax weights are exp(lse_i - logsumexp_i lse_i), a block
    with no key for a row (`finite_lse`) weighing 0 in it."""
    lse = finite_lse(torch.stack(lses))
    weights = torch.exp(lse - torch.logsumexp(lse, dim=0, keepdim=True))
    merged = (weights[..., None] * torch.stack([o.to(weights.dtype) for o in outs])).sum(dim=0)
    return merged.to(outs[0].dtype)


def widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` with zero columns up to `width` in its last dimension (itself when that wide): how a kernel that takes
    one head size runs MLA's V, narrower than its Q and K (zero columns of V give zero columns of the output,
    and nothing else changes, forward or backward)."""
    if x.shape[-1] >= width:
        return x
    return F.pad(x, (0, width - x.shape[-1]))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half precision and fp32, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def sum_kv_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[t, h, dh] gradient of heads repeated by `expand_kv_heads` -> [t, hk, dh]: each kv head sums over the
    query heads it serves."""
    t, h, dh = grad.shape
    return grad if h == kv_heads else grad.reshape(t, kv_heads, h // kv_heads, dh).sum(dim=2)
