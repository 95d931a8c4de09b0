"""The `varlen` kernel: torch's own flash-attention varlen kernels (CUDA, bf16/fp16), no package to install.

torch ships FlashAttention-2 inside its CUDA build (`aten::_flash_attention_forward` / `_backward`, behind
`torch.nn.attention.varlen.varlen_attn` since torch 2.10); the calls here are the aten operators themselves,
whose signatures are the same from torch 2.6 to 2.13, with a varlen call per question:

- causal samples: one call over the packed samples (`Spans.cu`);
- the all-gather: the group's keys back in position order (`zigzag_unpack`), each of this rank's runs of
  consecutive positions gathered with its sample's prefix of keys (`run_key_index`: an index built once per
  microbatch on the device), one call whose causal mask is bottom-right aligned, as flash attention's is;
- ring steps: the own block is one causal call; an earlier rank's block one full call of every query over the
  front chunks (gathered); a later rank's one full call of the back-chunk queries (gathered) over the block.
  Backward recomputes each from the merged output and log-sum-exp.

No mask, no host work: every tensor a call reads comes from the microbatch's `AttentionMeta`.
"""

from __future__ import annotations

import functools

import torch

from megatron_dhp.runtime.attention.math import MASKED, widened
from megatron_dhp.runtime.attention.meta import DIAGONAL, FRONT_KEYS, AttentionMeta, RingBlock, Spans
from megatron_dhp.runtime.fused import gather_rows

HALF = (torch.float16, torch.bfloat16)


def flash_applies(device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a flash-attention kernel cannot run on such tensors, or None: CUDA on Ampere or newer, bf16 or
    fp16, a head size that is a multiple of 8 up to 256."""
    if device_type != "cuda":
        return f"it needs a CUDA device, not {device_type}"
    if dtype not in HALF:
        return f"it needs bf16 or fp16, not {str(dtype).removeprefix('torch.')}"
    if head_dim % 8 or head_dim > 256:
        return f"it needs a head size that is a multiple of 8 up to 256, not {head_dim}"
    if not _ampere_or_newer():
        return "it needs an Ampere or newer GPU (compute capability 8.0)"
    return None


@functools.cache
def _ampere_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


class VarlenKernel:
    """torch's flash-attention varlen kernels (see the module docstring)."""

    def applies(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:  # noqa: D102
        return flash_applies(device_type, dtype, head_dim)

    def causal(self, q, k, v, spans: Spans, scale: float) -> torch.Tensor:  # noqa: D102
        dv = v.shape[-1]
        out = _Varlen.apply(q, k, widened(v, q.shape[-1]), spans.cu, spans.cu, spans.max_len, spans.max_len, True,
                            scale)
        return out[..., :dv]

    def gathered(self, q, k, v, meta: AttentionMeta, scale: float) -> torch.Tensor:  # noqa: D102
        dv = v.shape[-1]
        queries, keys = meta.runs.queries, meta.runs.keys
        k, v = (gather_rows(meta.zigzag.unpack(x), run_key_index(meta)) for x in (k, widened(v, q.shape[-1])))
        return _Varlen.apply(q, k, v, queries.cu, keys.cu, queries.max_len, keys.max_len, True, scale)[..., :dv]

    def block(self, q, k, v, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        dv, v = v.shape[-1], widened(v, q.shape[-1])
        local, halves, keys = meta.local, meta.halves, block.keys
        if block.kind == DIAGONAL:
            out, lse = _forward(q, k, v, local.cu, local.cu, local.max_len, local.max_len, True, scale)
        elif block.kind == FRONT_KEYS:
            k, v = k.index_select(0, keys.front_rows), v.index_select(0, keys.front_rows)
            out, lse = _forward(q, k, v, local.cu, keys.halves.cu, local.max_len, keys.halves.max_len, False, scale)
        else:
            rows = meta.back_rows
            o, s = _forward(q.index_select(0, rows), k, v, halves.cu, keys.spans.cu, halves.max_len,
                            keys.spans.max_len, False, scale)
            out = q.new_zeros(q.shape[0], *o.shape[1:]).index_copy_(0, rows, o)
            lse = s.new_full((s.shape[0], q.shape[0]), MASKED).index_copy_(1, rows, s)
        return out[..., :dv], lse.transpose(0, 1)

    def block_backward(self, grad, q, k, v, out, lse, block: RingBlock, meta: AttentionMeta, scale: float):  # noqa: D102
        dv, width = v.shape[-1], q.shape[-1]
        grad, v, out = (widened(x, width).to(q.dtype) for x in (grad, v, out))
        lse = lse.transpose(0, 1).float()
        local, halves, keys = meta.local, meta.halves, block.keys
        if block.kind == DIAGONAL:
            dq, dk, dvv = _backward(grad, q, k, v, out, lse, local.cu, local.cu, local.max_len, local.max_len, True,
                                    scale)
        elif block.kind == FRONT_KEYS:
            rows = keys.front_rows
            dq, dkf, dvf = _backward(grad, q, k.index_select(0, rows), v.index_select(0, rows), out, lse, local.cu,
                                     keys.halves.cu, local.max_len, keys.halves.max_len, False, scale)
            dk = torch.zeros_like(k).index_copy_(0, rows, dkf)
            dvv = torch.zeros_like(v).index_copy_(0, rows, dvf)
        else:
            rows = meta.back_rows
            dqb, dk, dvv = _backward(grad.index_select(0, rows), q.index_select(0, rows), k, v,
                                     out.index_select(0, rows), lse.index_select(1, rows), halves.cu, keys.spans.cu,
                                     halves.max_len, keys.spans.max_len, False, scale)
            dq = torch.zeros_like(q).index_copy_(0, rows, dqb)
        return dq.float(), dk.float(), dvv[..., :dv].float()


def run_key_index(meta: AttentionMeta) -> torch.Tensor:
    """The natural-order row of every key the all-gather's runs see, run after run (`AttentionMeta.runs`):
    built on the device at the microbatch's first layer and cached."""
    if "run_key_index" not in meta.cache:
        keys = meta.runs.keys
        cu = keys.cu.long()
        begin = torch.repeat_interleave(meta.runs.key_starts_on_device - cu[:-1], cu[1:] - cu[:-1],
                                        output_size=keys.total)
        meta.cache["run_key_index"] = begin + torch.arange(keys.total, device=begin.device)
    return meta.cache["run_key_index"]


def _forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [t, h, d] and log-sum-exp [h, t] (fp32)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                           scale=scale)
    return out, lse


def _backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `_forward` from an output and log-sum-exp [h, t] (merged or its own)."""
    rng, unused = _no_dropout_state(q.device)
    return torch.ops.aten._flash_attention_backward(grad.contiguous(), q, k, v, out.contiguous(), lse.contiguous(),
                                                    cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale)


@functools.cache
def _no_dropout_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The random state the backward takes and, without dropout, never reads (as torch's varlen_attn passes)."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


class _Varlen(torch.autograd.Function):
    """One varlen flash call, differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):  # noqa: D102
        out, lse = _forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _backward(grad, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None
