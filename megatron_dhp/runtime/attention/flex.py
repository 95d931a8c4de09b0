"""The `flex` kernel: FlexAttention with one block mask per microbatch and question, built once, reused by
every layer.

A mask is a predicate on row indices over the microbatch's device tensors (`AttentionMeta`): same sample and
key not after the query (causal samples, the all-gather's group rows by true position), or a ring step's kind
(own block causal, an earlier rank's front chunks, a later rank's back-chunk queries). `create_block_mask`
turns it into a `BlockMask` (compiled on a GPU, so the dense predicate is never materialised), cached in the
metadata, so the number of operations a layer issues does not depend on the number of samples. On a GPU
`flex_attention` is compiled by Triton (fp32 and head sizes flash attention lacks included); on a CPU torch
runs its forward only, so `flex` there serves as a forward-only check, never `auto`'s choice.

Ring backward: FlexAttention has no entry that takes a merged log-sum-exp back, so each step's block is
recomputed with autograd and differentiated through its own output and log-sum-exp, weighted by its share of
the merged softmax (w = exp(lse_block - lse_merged)): dO_block = w dO, dlse_block = w <dO, O_block - O>.

Compilation: every question (the causal, all-gather and three ring-step masks) and grad mode has a small
compiled function of its own (`_compiled`: one code object each, so dynamo's recompile limit counts each one's
shapes alone), and so has each question's block-mask builder. One `flex_attention` compiled for all of them
passed the limit (8) within a ring of 2, after which dynamo ran FlexAttention eagerly: dense scores, 128 GiB at
32K tokens x 32 heads. Past the limit a compiled function now fails with a line naming it instead.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch.nn.attention import flex_attention as _flex_api

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention.math import MASKED, accumulation_dtype, widened
from megatron_dhp.runtime.attention.meta import (
    BACK_QUERIES,
    DIAGONAL,
    RING_BLOCKS,
    AttentionMeta,
    RingBlock,
    Spans,
)


class FlexKernel:
    """FlexAttention (see the module docstring)."""

    def applies(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:  # noqa: D102
        if device_type == "cuda" and not _has_triton():
            return "FlexAttention on a GPU needs Triton"
        if device_type not in ("cuda", "cpu"):
            return f"FlexAttention runs on CUDA or (forward only) the CPU, not {device_type}"
        if head_dim < 16:
            return f"FlexAttention needs a head size of at least 16, not {head_dim}"
        return None

    def causal(self, q, k, v, spans: Spans, scale: float) -> torch.Tensor:  # noqa: D102
        if "flex-causal" not in spans.cache:
            seg = spans.row_segments()
            spans.cache["flex-causal"] = _block_mask(lambda b, h, i, j: (seg[i] == seg[j]) & (j <= i),
                                                     spans.total, spans.total, seg.device, CAUSAL)
        return _attend(q, k, v, spans.cache["flex-causal"], scale, CAUSAL)[0]

    def gathered(self, q, k, v, meta: AttentionMeta, scale: float) -> torch.Tensor:  # noqa: D102
        if "flex-gathered" not in meta.cache:
            q_pos, q_seg = meta.positions, meta.segments
            k_pos, k_seg = meta.group_rows()
            meta.cache["flex-gathered"] = _block_mask(
                lambda b, h, i, j: (q_seg[i] == k_seg[j]) & (k_pos[j] <= q_pos[i]), q_pos.numel(), k_pos.numel(),
                meta.device, GATHERED)
        return _attend(q, k, v, meta.cache["flex-gathered"], scale, GATHERED)[0]

    def block(self, q, k, v, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        with torch.no_grad():
            out, lse = _attend(q, k, v, _ring_mask(block, meta), scale, block.kind)
        return out, lse

    def block_backward(self, grad, q, k, v, out, lse, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        acc = accumulation_dtype(q.dtype)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            o, s = _attend(*leaves, _ring_mask(block, meta), scale, block.kind)
            weight = torch.exp(s.to(acc) - lse.to(acc))  # this block's share of each row's merged softmax
            grad_o = (grad.to(acc) * weight[..., None]).to(o.dtype)
            grad_s = weight * (grad.to(acc) * (o.to(acc) - out.to(acc))).sum(dim=-1)
            dq, dk, dv = torch.autograd.grad((o, s), leaves, (grad_o, grad_s.to(s.dtype)))
        return dq.to(acc), dk.to(acc), dv.to(acc)


def _ring_mask(block: RingBlock, meta: AttentionMeta):
    """The block mask of ring step `block`, this rank's rows over the block's (cached per microbatch)."""
    key = f"flex-{block.name}"
    if key not in meta.cache:
        seg, keys = meta.segments, block.keys
        key_seg = keys.spans.row_segments()
        if block.kind == DIAGONAL:
            def mask(b, h, i, j):
                return (seg[i] == key_seg[j]) & (j <= i)
        elif block.kind == BACK_QUERIES:
            front = meta.shard.front()

            def mask(b, h, i, j):
                return (seg[i] == key_seg[j]) & ~front[i]
        else:
            front = keys.front()

            def mask(b, h, i, j):
                return (seg[i] == key_seg[j]) & front[j]
        meta.cache[key] = _block_mask(mask, seg.numel(), key_seg.numel(), meta.device, block.kind)
    return meta.cache[key]


CAUSAL, GATHERED = "causal", "gathered"
QUESTIONS: tuple[str, ...] = (CAUSAL, GATHERED, *RING_BLOCKS)
"""The masks FlexAttention answers: a sample's own causal keys, the all-gather's group rows, each ring step."""
COMPILE_BACKEND: dict[str, str | None] = {"cuda": "inductor", "cpu": None}
"""torch.compile's backend for FlexAttention and its block masks, per device type (None: eager, the CPU's
forward-only reference; a test compiles it there with `aot_eager` to count the compilations)."""


def _block_mask(mask: Callable, rows: int, cols: int, device: torch.device, question: str):
    """The `BlockMask` of `mask` over [rows, cols], built by `question`'s own compiled builder."""
    build = _compiled(_build_mask, f"flex_block_mask_{question}", COMPILE_BACKEND.get(device.type))
    return _guarded(build, mask, rows, cols, device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float, question: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """[t, h, d] FlexAttention under `block_mask` (one of `question`'s): output [t, h, dv] and log-sum-exp
    [t, h] (`MASKED` where a query sees nothing)."""
    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise DhpError("FlexAttention runs forward only on a CPU (torch has no CPU backward for it); use the "
                       "sdpa backend there, or flex under torch.no_grad()")
    dv, h = v.shape[-1], q.shape[1]
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, widened(v, q.shape[-1])))
    mode = "grad" if torch.is_grad_enabled() else "no_grad"
    attend = _compiled(_flex_call, f"flex_{question}_{mode}", COMPILE_BACKEND.get(q.device.type))
    out, lse = _guarded(attend, q4, k4, v4, block_mask, scale, k.shape[1] != h)
    return out[0].transpose(0, 1)[..., :dv], lse[0].transpose(0, 1).clamp(min=MASKED)


def _flex_call(q, k, v, block_mask, scale: float, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The body every compiled attention function runs: FlexAttention's output and log-sum-exp."""
    if _AUX is None:  # a torch without `AuxRequest` (before 2.9): the older flag
        return _flex_api.flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                        return_lse=True)
    out, aux = _flex_api.flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                        return_aux=_AUX(lse=True))
    return out, aux.lse


def _build_mask(mask: Callable, rows: int, cols: int, device: torch.device):
    """The body every compiled block-mask builder runs."""
    return _flex_api.create_block_mask(mask, None, None, rows, cols, device=device)


_AUX = getattr(_flex_api, "AuxRequest", None)


@functools.cache
def _compiled(body: Callable, name: str, backend: str | None) -> Callable:
    """`body` as a function of its own named `name` (a code object of its own: dynamo keeps its compilations,
    and counts them against its recompile limit, per code object), compiled with `backend` (None: eager)."""
    code = body.__code__.replace(co_name=name, co_qualname=name)
    fn = types.FunctionType(code, body.__globals__, name, body.__defaults__, body.__closure__)
    return fn if backend is None else torch.compile(fn, backend=backend, dynamic=True)


def _guarded(fn: Callable, *args):
    """`fn(*args)`; a compiled `fn` past dynamo's recompile limit fails with a line rather than running eagerly
    (FlexAttention's eager path is dense attention: out of memory at long context)."""
    if not hasattr(fn, "_torchdynamo_orig_callable"):
        return fn(*args)
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        with dynamo_config.patch(fail_on_recompile_limit_hit=True):
            return fn(*args)
    except FailOnRecompileLimitHit:
        name = getattr(fn, "__name__", None) or fn._torchdynamo_orig_callable.__name__
        limit = getattr(dynamo_config, "recompile_limit", None) or getattr(dynamo_config, "cache_size_limit", "its")
        raise DhpError(f"FlexAttention's {name} was compiled for {limit} shapes and would "
                       "now run eagerly, as dense attention; use the varlen or sdpa attention backend "
                       "(attention_backend), or raise torch._dynamo.config.recompile_limit") from None


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
