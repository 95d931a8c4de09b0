"""Every local kernel and comm variant against the oracle on virtual groups, and a layer with no host sync.

A virtual group (`testing.virtual_group`) runs d ranks' attention in one process, communication done by
indexing, so each backend's three questions (causal samples, the all-gather's gathered keys, ring blocks with
their backward from the merged log-sum-exp) are checked against the `math` oracle on one whole process.
The GPU kernels' own calls are checked on a CPU through reference implementations of their contracts
(torch's flash varlen operators, flash-attn's varlen function); the real kernels are checked on a GPU by
the CUDA tests below and `scripts/gpu_check.sh`.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.launch.ranks import launch
from megatron_dhp.runtime.attention import flash, kernels, sdpa, varlen
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.core_attention import dynamic_cp_attention
from megatron_dhp.runtime.attention.kernels import kernel, resolve
from megatron_dhp.runtime.attention.meta import AttentionMeta
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.testing.host_sync import HostSyncError, NoHostSync
from megatron_dhp.testing.virtual_group import virtual_group
from tests.numerics import RELATIVE, relative_diff
from tests.runtime import sync_workers

LENGTHS = (13, 1, 30, 7, 2)
COMMS = ("allgather", "ulysses", "ring")


def inputs(dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, dk: int = 16, dv: int = 16, seed: int = 0,
           lengths: tuple[int, ...] = LENGTHS, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return tuple(torch.randn(t, n, d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
                 for n, d in ((heads, dk), (kv_heads, dk), (kv_heads, dv), (heads, dv)))


def oracle(q, k, v, g, lengths=LENGTHS):
    """fp64 math on one process: output and gradients."""
    return virtual_group(*(x.double().cpu() for x in (q, k, v, g)), lengths, 1, "allgather", kernel("math"), 0.3)


def assert_matches(got, want, rtol):
    """Each of output, dq, dk, dv within `rtol` of the oracle's largest |value| (3 to 6 here; fp32 kernels
    measure up to 5e-7 of it, a wrong mask or block O(1))."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = relative_diff(a, b)
        assert err <= rtol, (name, err)


FP64 = 1e-10
"""fp64 kernels against the fp64 oracle, relative: sums in another order differ by ~1e-15 (measured 9e-16)."""


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, FP64), (torch.float32, RELATIVE)])
def test_every_cpu_kernel_and_variant_equals_the_oracle(backend, comm, size, dtype, rtol):
    """Output and dq, dk, dv; GQA 4/2; samples shorter than the group (1, 2 tokens) pad to whole chunks."""
    q, k, v, g = inputs(dtype)
    assert_matches(virtual_group(q, k, v, g, LENGTHS, size, comm, kernel(backend), 0.3), oracle(q, k, v, g), rtol)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("comm", COMMS)
def test_values_narrower_than_keys(backend, comm):
    """MLA: V heads 12 wide against Q/K 16, on a group of 3."""
    q, k, v, g = inputs(torch.float64, dv=12)
    assert_matches(virtual_group(q, k, v, g, LENGTHS, 3, comm, kernel(backend), 0.3), oracle(q, k, v, g), FP64)


def test_sdpa_query_blocks(monkeypatch):
    """The all-gather's runs in query blocks of 5 rows (several per run, the last short)."""
    monkeypatch.setattr(sdpa, "QUERY_BLOCK", 5)
    q, k, v, g = inputs(torch.float64)
    assert_matches(virtual_group(q, k, v, g, LENGTHS, 2, "allgather", kernel("sdpa"), 0.3), oracle(q, k, v, g), FP64)


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_flex_forward_equals_the_oracle_on_the_cpu(comm, size):
    """FlexAttention's block masks per microbatch and ring step: forward only (torch has no CPU backward)."""
    q, k, v, g = inputs(torch.float32)
    with torch.no_grad():
        (out,) = virtual_group(q, k, v, None, LENGTHS, size, comm, kernel("flex"), 0.3)
    assert relative_diff(out, oracle(q, k, v, g)[0]) <= RELATIVE


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
    """torch's `_flash_attention_forward` contract on a CPU: per sequence, causal aligned bottom-right; output
    and log-sum-exp [h, t]."""
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
    kk, vv = (x.repeat_interleave(q.shape[1] // k.shape[1], 1).float() for x in (k, v))
    for i in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        assert nq <= max_q and nk <= max_k
        scores = torch.einsum("qhd,khd->hqk", q[qs].float(), kk[ks]) * scale
        if causal:
            scores = scores.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + (nk - nq), -math.inf)
        lse[:, qs] = torch.logsumexp(scores, -1)
        out[qs] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv[ks]).to(q.dtype)
    return out, lse, None, None, None


def _flash_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *, scale):
    """torch's `_flash_attention_backward` contract on a CPU: gradients from a given output and lse."""
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    for i in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        qq, gg, oo = (x[qs].float().transpose(0, 1) for x in (q, grad, out))
        kk, vv = (x[ks].float().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
        scores = torch.bmm(qq, kk.transpose(1, 2)) * scale
        if causal:
            scores = scores.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + (nk - nq), -math.inf)
        probs = torch.exp(scores - lse[:, qs, None])
        ds = probs * (torch.bmm(gg, vv.transpose(1, 2)) - (gg * oo).sum(-1, keepdim=True))
        dq[qs] = (torch.bmm(ds, kk) * scale).transpose(0, 1)
        dk[ks] += (torch.bmm(ds.transpose(1, 2), qq) * scale).transpose(0, 1).reshape(nk, k.shape[1], group, -1).sum(2)
        dv[ks] += torch.bmm(probs.transpose(1, 2), gg).transpose(0, 1).reshape(nk, k.shape[1], group, -1).sum(2)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


class _Ops:
    _flash_attention_forward = staticmethod(_flash_forward)
    _flash_attention_backward = staticmethod(_flash_backward)


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("dv", [16, 12])
def test_varlen_kernel_calls_on_a_reference_flash(comm, size, dv, monkeypatch):
    """The varlen kernel's cu_seqlens, gathered keys, ring-step row selections and its backward from the merged
    log-sum-exp, run against a CPU reference of torch's flash operators (fp32, as the kernels accumulate)."""
    monkeypatch.setattr(varlen.torch.ops, "aten", _Ops, raising=False)
    q, k, v, g = inputs(torch.float32, dv=dv)
    assert_matches(virtual_group(q, k, v, g, LENGTHS, size, comm, kernel("varlen"), 0.3), oracle(q, k, v, g), RELATIVE)


@pytest.mark.parametrize("comm", ["allgather", "ulysses"])
def test_flash_attn_kernel_inputs_on_a_reference_varlen_function(comm, monkeypatch):
    """flash-attn's `flash_attn_varlen_func` contract (bottom-right causal) on a CPU: what the flash kernel
    hands it for whole samples and for the all-gather's runs."""
    def reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        return _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=softmax_scale)[0]

    monkeypatch.setattr(flash, "varlen_func", lambda: reference)
    q, k, v, g = inputs(torch.float32)
    with torch.no_grad():
        (out,) = virtual_group(q, k, v, None, LENGTHS, 3, comm, kernel("flash"), 0.3)
    assert relative_diff(out, oracle(q, k, v, g)[0]) <= RELATIVE


def test_a_flash_attn_older_than_2_1_is_refused_by_name(monkeypatch):
    """flash-attn < 2.1 aligns its causal mask top-left: the all-gather's runs would be silently wrong."""
    import sys
    import types

    monkeypatch.setattr(flash, "varlen_func", lambda: object())
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.0.9"))
    assert "flash-attn 2.0.9 is older than 2.1" in flash.FlashAttnKernel().applies("cuda", torch.bfloat16, 128)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.7.4"))
    assert "flash-attn" not in (flash.FlashAttnKernel().applies("cuda", torch.bfloat16, 128) or "")  # device rules


def test_auto_takes_sdpa_on_a_cpu_and_named_kernels_refuse_what_they_cannot_run():
    q = torch.zeros(4, 2, 16)
    assert isinstance(resolve("auto", q), sdpa.SdpaKernel)
    with pytest.raises(DhpError, match="varlen.*CUDA"):
        resolve("varlen", q)
    with pytest.raises(DhpError, match="unknown"):
        resolve("fast", q)
    assert "sdpa" in kernels.describe("auto", "cpu")


def test_flex_refuses_a_cpu_backward_clearly():
    layout = MicrobatchLayout((0,), (8,), 1, 0)
    q, k, v = (torch.randn(8, 2, 16, requires_grad=True) for _ in range(3))
    with pytest.raises(DhpError, match="forward only on a CPU"):
        dynamic_cp_attention(q, k, v, CPContext(layout, None, backend="flex"), 0.25)


def test_metadata_grows_with_tokens_and_samples_never_their_square():
    """Every tensor a microbatch's attention reads, for 64K tokens on a group of 4: O(tokens + samples)."""
    lengths = (40000, 20000, *([100] * 55))
    meta = AttentionMeta.build(MicrobatchLayout(tuple(range(len(lengths))), lengths, 4, 1))
    tensors = [meta.cu_seqlens, meta.positions, meta.segments, meta.front_rows, meta.back_rows, meta.local.cu,
               meta.natural.cu, meta.halves.cu, meta.zigzag.sources]
    t = meta.layout.num_slots
    assert sum(x.numel() for x in tensors) <= 4 * t + 4 * sum(lengths) + 4 * len(lengths)


def test_the_guard_names_what_would_sync():
    """`NoHostSync` is what the layer test relies on: it must catch each kind of host round-trip."""
    x = torch.arange(4)
    for call in (lambda: x.tolist(), lambda: int(x[1]), lambda: x[x > 1], lambda: torch.tensor([1, 2]),
                 lambda: torch.unique(x), lambda: torch.repeat_interleave(x, x)):
        with pytest.raises(HostSyncError), NoHostSync():
            call()
    found: list[str] = []  # given a list, it records each one and runs it (ranks in collectives stay in step)
    with NoHostSync(found):
        assert x.tolist() == [0, 1, 2, 3] and int(x[1]) == 1
    assert found[0].startswith("Tensor.tolist") and found[1].startswith("aten._local_scalar_dense") and len(found) == 2


@pytest.fixture(scope="module")
def host_syncs() -> list[dict]:
    """Four gloo ranks: groups of 1 to 4, every variant; 64 samples of 8 tokens against one of 512."""
    return launch(sync_workers.layers_without_host_sync, 4, (37, 2, 90, 11), (8,) * 64, timeout_s=300)


@pytest.mark.parametrize("comm", sync_workers.COMMS)
def test_a_layer_issues_no_host_sync_and_flex_ops_do_not_grow_with_samples(host_syncs, comm):
    """Two layers' forward and backward with the CPU's `auto` kernel, and flex's forward, under `NoHostSync`
    (no `item`/`tolist`, `nonzero`, `unique`, boolean index, host-built tensor or device copy); and one flex
    layer issues as many operators for 64 samples as for one of the same total."""
    for rank, found in enumerate(host_syncs):
        for key, value in found.items():
            if key[1] == comm or key[0] == 1:
                if key[2] == "ops":
                    assert value[0] == value[1], (rank, key, value)
                else:
                    assert value is None, (rank, key, value)


def test_a_step_of_an_mtp_model_and_of_the_vlm_issues_no_host_sync_in_the_model():
    """Every microbatch's forward and backward of a GPT with multi-token prediction (its token roll on the
    dynamic layout) and of the vision-language model (its tower, and image rows merged into the embeddings)
    under `NoHostSync`, on 3 ranks; and still exact."""
    for rank, found in enumerate(launch(sync_workers.model_steps_without_host_sync, 3, 5, timeout_s=300)):
        assert found == {"mtp": None, "vlm": None}, (rank, found)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("backend", ["varlen", "flex"])
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_gpu_kernels_equal_the_oracle(backend, comm, size):
    """bf16 on the GPU against the fp64 oracle, output and every gradient, relative to the largest value."""
    q, k, v, g = inputs(torch.bfloat16, heads=8, kv_heads=2, dk=64, dv=64, device="cuda")
    got = virtual_group(q, k, v, g, LENGTHS, size, comm, kernel(backend), 0.125)
    want = virtual_group(*(x.double().cpu() for x in (q, k, v, g)), LENGTHS, 1, "allgather", kernel("math"), 0.125)
    for a, b in zip(got, want):
        assert relative_diff(a, b) <= 2e-2  # bf16: ~5 ulps of the largest value


@pytest.mark.parametrize("size", [2, 3, 4])
def test_flex_ring_backward_by_recompute_through_the_blocks_lse(size, monkeypatch):
    """FlexAttention has no backward that takes a merged log-sum-exp, so the flex kernel recomputes each ring
    block with autograd and weights its output and lse gradients by the block's share of the merged softmax.
    torch runs no flex backward on a CPU, so that rule runs here on a differentiable stand-in for FlexAttention
    under the same per-kind masks (the oracle's), fp64: output and every gradient equal the oracle's."""
    from megatron_dhp.runtime.attention import flex
    from megatron_dhp.runtime.attention.math import MASKED, block_attention
    from megatron_dhp.runtime.attention.oracle import ring_block_mask

    def attend(q, k, v, mask, scale, question):
        out, lse = block_attention(q, k, v, mask, scale)
        return out.masked_fill(~mask.any(dim=1)[:, None, None], 0), lse.clamp(min=MASKED)

    monkeypatch.setattr(flex, "_ring_mask", ring_block_mask)
    monkeypatch.setattr(flex, "_attend", attend)
    q, k, v, g = inputs(torch.float64)
    assert_matches(virtual_group(q, k, v, g, LENGTHS, size, "ring", kernel("flex"), 0.3), oracle(q, k, v, g), FP64)
