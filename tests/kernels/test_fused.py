"""The torch path of `runtime.fused` against the zigzag definition, as plain index arithmetic (no GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime import fused
from megatron_dhp.runtime.attention.math import merge_partials
from megatron_dhp.runtime.fused import gather_rows, lse_merge, scatter_rows, zigzag_pack, zigzag_unpack
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.testing.virtual_group import host_group_rows


def cu_of(lengths):
    return list(itertools.accumulate(lengths, initial=0))


def reference_sources(lengths, d, ranks):
    """Whole-tensor row of each shard row (None = padding), from the definition: samples padded to 2d
    chunks of ceil(L / 2d) rows, rank r keeping chunk r then chunk 2d-1-r; d = 1 keeps the sample whole."""
    rows = []
    for r in ranks:
        for start, n in zip(cu_of(lengths), lengths):
            if d == 1:
                rows += [start + p for p in range(n)]
                continue
            chunk = -(-n // (2 * d))
            for c in (r, 2 * d - 1 - r):
                rows += [start + p if p < n else None for p in range(c * chunk, (c + 1) * chunk)]
    return rows


def reference_pack(x, lengths, d, ranks, pad_value):
    pad = torch.full(x.shape[1:], pad_value, dtype=x.dtype)
    rows = [pad if i is None else x[i] for i in reference_sources(lengths, d, ranks)]
    return torch.stack(rows) if rows else x.new_empty((0, *x.shape[1:]))


def distinct_rows(num_rows, dtype, width=(2, 3)):
    values = torch.arange(num_rows * 6, dtype=torch.float64).view(num_rows, *width) + 1
    return values.to(dtype) if dtype != torch.bool else (values.long() % 3 == 0)


def ranks_of(d, rank):
    return range(d) if rank is None else [rank]


CASES = [
    ([10], 3), ([5, 10], 3), ([1, 2, 3, 4], 5), ([29, 1, 60], 5), ([11, 12, 13], 6), ([1], 6),
    ([50, 7, 0, 3], 7), ([14], 7), ([3, 8], 1), ([9, 4], 2), ([17, 1, 33], 4), ([64, 65], 8),
]


@pytest.mark.parametrize("lengths,d", CASES)
@pytest.mark.parametrize("dtype,pad_value", [(torch.float32, -7.5), (torch.int64, -1), (torch.bfloat16, 0.0), (torch.bool, True)])
def test_pack_matches_definition_for_every_rank(lengths, d, dtype, pad_value):
    x = distinct_rows(sum(lengths), dtype)
    for rank in [*range(d), None]:
        got = zigzag_pack(x, torch.tensor(cu_of(lengths), dtype=torch.int32), d, rank, pad_value)
        assert got.dtype == dtype
        assert torch.equal(got, reference_pack(x, lengths, d, ranks_of(d, rank), pad_value)), (rank, got)


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), max_size=6), d=st.integers(1, 9), data=st.data())
def test_pack_and_unpack_round_trip(lengths, d, data):
    rank = data.draw(st.one_of(st.none(), st.integers(0, d - 1)))
    x = distinct_rows(sum(lengths), torch.float32)
    cu = cu_of(lengths)
    shard = zigzag_pack(x, cu, d, rank, pad_value=-1.5)
    assert torch.equal(shard, reference_pack(x, lengths, d, ranks_of(d, rank), -1.5))
    back = zigzag_unpack(shard, cu, d, rank)
    held = torch.zeros(sum(lengths), dtype=torch.bool)
    held[[i for i in reference_sources(lengths, d, ranks_of(d, rank)) if i is not None]] = True
    # real tokens come back bit for bit, padding is dropped, tokens of other ranks read 0
    assert torch.equal(back[held], x[held]) and not back[~held].any()
    # and the other way: packing the unpacked shard restores it
    assert torch.equal(zigzag_pack(back, cu, d, rank, pad_value=-1.5), shard)


def test_every_rank_together_restores_every_token_once():
    lengths, d = [23, 1, 40, 6], 5
    x = distinct_rows(sum(lengths), torch.float64)
    per_rank = [zigzag_unpack(zigzag_pack(x, cu_of(lengths), d, r, -1.0), cu_of(lengths), d, r) for r in range(d)]
    assert torch.equal(sum(per_rank), x)
    assert torch.equal((torch.stack(per_rank) != 0).sum(0), torch.ones_like(x, dtype=torch.long))


@pytest.mark.parametrize("d", [1, 2, 3, 5, 6, 7])
def test_pack_agrees_with_the_runtime_layout(d):
    """Packing each token's position within its sample gives `MicrobatchLayout.positions`, -1 on padding."""
    layout = MicrobatchLayout(sample_ids=(4, 2, 9), lengths=(13, 1, 30), group_size=d, rank=0)
    positions = torch.cat([torch.arange(n) for n in layout.lengths])
    for r in range(d):
        packed = zigzag_pack(positions, layout.cu_seqlens, d, r, pad_value=-1)
        real = layout.real(r)
        assert torch.equal(packed[real], layout.positions(r)[real]) and bool((packed[~real] == -1).all())
    assert torch.equal(zigzag_pack(positions, layout.cu_seqlens, d, None, pad_value=-1) >= 0, torch.cat(
        [layout.real(r) for r in range(d)]
    ))


@pytest.mark.parametrize("d", [2, 3, 6])
def test_unpack_of_the_group_is_flash_natural_order(d):
    """What flash needs: the group's rank-major slots in sample, position order (the argsort it replaced)."""
    layout = MicrobatchLayout(sample_ids=(0, 1), lengths=(11, 25), group_size=d, rank=0)
    positions, segments = host_group_rows(layout)
    slots = torch.randn(positions.numel(), 2, 3)
    natural = torch.argsort(segments * (layout.max_seqlen + 1) + positions)
    assert torch.equal(zigzag_unpack(slots, layout.cu_seqlens_padded, d, None), slots[natural])
    assert torch.equal(zigzag_pack(slots[natural], layout.cu_seqlens_padded, d, None), slots)


def test_empty_inputs():
    for cu in ([0], [0, 0, 0]):
        assert zigzag_pack(torch.empty(0, 4), cu, 3, 1).shape == (0, 4)
        assert zigzag_unpack(torch.empty(0, 4), cu, 3, None).shape == (0, 4)
    no_width = torch.empty(10, 0)
    assert zigzag_pack(no_width, [0, 10], 3, 2).shape == (4, 0)
    assert gather_rows(torch.randn(5, 2), torch.empty(0, dtype=torch.int64)).shape == (0, 2)
    assert scatter_rows(torch.empty(0, 2), torch.empty(0, dtype=torch.int64), 3).equal(torch.zeros(3, 2))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: zigzag_pack(torch.zeros(5, 1), [1, 5], 2, 0), "must start at 0"),
        (lambda: zigzag_pack(torch.zeros(5, 1), [0, 5, 3], 2, 0), "never decrease"),
        (lambda: zigzag_pack(torch.zeros(5, 1), [0, 5], 2, 2), "rank 2 is outside a group of 2"),
        (lambda: zigzag_pack(torch.zeros(5, 1), [0, 5], 0, None), "group_size must be at least 1"),
        (lambda: zigzag_pack(torch.zeros(6, 1), [0, 5], 2, 0), "take 5 rows"),
        (lambda: zigzag_unpack(torch.zeros(3, 1), [0, 5], 2, 0), "take 4 rows"),
        (lambda: zigzag_unpack(torch.zeros(4, 1), [0, 5], 2, None), "take 8 rows"),
        (lambda: gather_rows(torch.zeros(5, 1), torch.zeros(2, 2, dtype=torch.int64)), "1-D index"),
        (lambda: scatter_rows(torch.zeros(5, 1), torch.arange(4), 9), "4 entries for 5 rows"),
    ],
)
def test_bad_arguments_are_user_errors(call, message):
    with pytest.raises(DhpError, match=message):
        call()


def test_gather_and_scatter_match_indexing():
    x = distinct_rows(9, torch.float32)
    index = torch.tensor([8, 0, 0, 3, 8, 1])
    assert torch.equal(gather_rows(x, index), torch.stack([x[i] for i in index.tolist()]))
    perm = torch.tensor([4, 0, 7, 2, 8, 1, 6, 3, 5])
    scattered = scatter_rows(x, perm, 11)
    for i, p in enumerate(perm.tolist()):
        assert torch.equal(scattered[p], x[i])
    assert not scattered[[9, 10]].any()
    assert torch.equal(gather_rows(scattered, perm), x)
    assert torch.equal(gather_rows(x, index.to(torch.int32)), gather_rows(x, index))
    with pytest.raises(IndexError):
        gather_rows(x, torch.tensor([9]))
    with pytest.raises(IndexError):
        scatter_rows(x[:1], torch.tensor([11]), 11)


@pytest.mark.parametrize("rank", [0, 2, None])
def test_gradients_are_exact_adjoints(rank):
    lengths, d = [7, 2, 12], 3
    x = torch.randn(sum(lengths), 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: zigzag_pack(t, cu_of(lengths), d, rank, 5.0), (x,))
    rows = (1 if rank is not None else d) * len(reference_sources(lengths, d, [0]))
    shard = torch.randn(rows, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: zigzag_unpack(t, cu_of(lengths), d, rank), (shard,))


def test_gather_and_scatter_gradients():
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    repeated = torch.tensor([5, 0, 5, 5, 2])
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, repeated), (x,))
    assert torch.autograd.gradcheck(lambda t: scatter_rows(t, torch.tensor([3, 0, 7, 1, 2, 6]), 9), (x,))


def merge_inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outs = [torch.randn(5, 3, 8, generator=gen).to(dtype) for _ in range(4)]
    lses = [(torch.randn(5, 3, generator=gen) * 4).to(torch.promote_types(dtype, torch.float32)) for _ in range(4)]
    lses[1][2] = -1.0e30  # a block where a query sees no key, as ring attention produces
    return outs, lses


def test_lse_merge_on_cpu_is_merge_partials_bit_for_bit():
    outs, lses = merge_inputs(torch.float32)
    leaves = [t.requires_grad_() for t in outs + lses]
    got, want = lse_merge(outs, lses), merge_partials(outs, lses)
    assert torch.equal(got, want)
    weights = torch.randn_like(got)
    assert all(
        torch.equal(a, b)
        for a, b in zip(torch.autograd.grad((got * weights).sum(), leaves), torch.autograd.grad((want * weights).sum(), leaves))
    )


@pytest.mark.parametrize("empty", [float("inf"), float("-inf"), -1.0e30], ids=["flash +inf", "-inf", "MASKED"])
def test_a_block_without_keys_weighs_nothing_in_the_merge(empty):
    # Flash attention writes +inf for a row whose key range is empty, a masked softmax -inf: the row merges to
    # exactly what the other blocks give, and no gradient is NaN.
    outs, lses = merge_inputs(torch.float32)
    outs[3], lses[3] = torch.zeros_like(outs[3]), lses[3].clone()
    lses[3][1:4] = empty
    leaves = [t.requires_grad_() for t in outs + lses]
    merged = lse_merge(leaves[:4], leaves[4:])
    rows = [0, 4]  # where block 3 has keys, it counts
    assert torch.equal(merged[1:4], merge_partials(leaves[:3], leaves[4:7])[1:4].detach())
    assert not torch.equal(merged[rows], merge_partials(leaves[:3], leaves[4:7])[rows])
    grads = torch.autograd.grad(merged.sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[7][1:4], torch.zeros(3, 3))


def test_merge_backward_formula_of_the_kernel():
    """lse_merge.cu's backward: grad_out_j = w_j g, grad_lse_j = w_j (D_j - sum_i w_i D_i), D_j = <g, out_j>."""
    outs, lses = merge_inputs(torch.float64, seed=1)
    leaves = [t.requires_grad_() for t in outs + lses]
    g = torch.randn(5, 3, 8, dtype=torch.float64)
    autograd = torch.autograd.grad((merge_partials(outs, lses) * g).sum(), leaves)
    lse = torch.stack(lses).detach()
    w = torch.exp(lse - torch.logsumexp(lse, 0))
    dots = (torch.stack(outs).detach() * g).sum(-1)
    formula = [w_j[..., None] * g for w_j in w] + list(w * (dots - (w * dots).sum(0)))
    for a, b in zip(autograd, formula):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # fp64, values of a few units: 1e-12 is 500+ ulps


def test_cpu_calls_never_build_or_load_kernels():
    fused._load_kernels.cache_clear()
    zigzag_pack(torch.zeros(4, 1), [0, 4], 2, 1)
    lse_merge(*merge_inputs(torch.float32))
    assert fused._load_kernels.cache_info().currsize == 0


def test_kernel_settings_fall_back_without_failing(monkeypatch):
    monkeypatch.setenv("MEGATRON_DHP_CSRC", "0")
    assert fused._load_kernels.__wrapped__() is None
    monkeypatch.setenv("MEGATRON_DHP_CSRC", "/nonexistent/libmegatron_dhp_csrc.so")
    with pytest.warns(UserWarning, match="using the torch fallback"):
        assert fused._load_kernels.__wrapped__() is None


def test_a_prebuilt_library_is_loaded_only_while_newer_than_its_sources(monkeypatch, tmp_path):
    """`scripts/build_csrc.sh` (one command, no GPU) writes the library a job then loads at start-up without a
    JIT build; an edited source makes it stale (JIT again), and MEGATRON_DHP_CSRC names another."""
    import os

    csrc, library = tmp_path / "csrc", tmp_path / "build" / "csrc" / "libmegatron_dhp_csrc.so"
    csrc.mkdir()
    (csrc / "copy.cu").write_text("// a kernel")
    monkeypatch.setattr(fused, "_CSRC", csrc)
    monkeypatch.setattr(fused, "PREBUILT", library)
    monkeypatch.delenv("MEGATRON_DHP_CSRC", raising=False)
    assert fused.kernel_library() is None  # nothing built: JIT
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    os.utime(csrc / "copy.cu", (1, 1))
    assert fused.kernel_library() == library
    os.utime(csrc / "copy.cu", None)
    os.utime(library, (2, 2))
    assert fused.kernel_library() is None  # a source edited after the build
    monkeypatch.setenv("MEGATRON_DHP_CSRC", "/elsewhere/lib.so")
    assert str(fused.kernel_library()) == "/elsewhere/lib.so"
