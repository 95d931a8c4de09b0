"""Uneven shards (`plan.shares`) in the runtime: the layout against its definition, every kernel's answers on
uneven blocks against the causal mask, and gloo runs of a real megatron-core GPT under every comm variant
(groups of 2, 3 and 4; TP 2 + SP; PP 2; MoE's allgather dispatcher; a vision-language model; MTP) against
one process. A rank that mis-sizes the shares makes the comparison fail, so the check can see what it guards.

The quick tier (no process started) checks the layout, the metadata, the kernels and the refusals in a few
seconds; the launches are `slow`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.errors import DhpError
from megatron_dhp.launch.ranks import launch
from megatron_dhp.plan.comm import COMM_VARIANTS, CommPolicy
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.plan.shares import shard_chunks
from megatron_dhp.runtime import rope
from megatron_dhp.runtime.attention.kernels import kernel
from megatron_dhp.runtime.attention.math import block_attention, visible
from megatron_dhp.runtime.attention.meta import AttentionMeta
from megatron_dhp.runtime.attention.ring import merged_blocks
from megatron_dhp.runtime.engine import check_shares
from megatron_dhp.runtime.fused import zigzag_pack, zigzag_unpack
from megatron_dhp.runtime.layout import MicrobatchLayout, group_layout, zigzag_positions
from megatron_dhp.runtime.slots import aligned_slot_rows
from megatron_dhp.testing.virtual_group import host_group_rows
from tests.numerics import RELATIVE
from tests.runtime import uneven_workers
from tests.runtime.test_distributed import assert_exact

lengths_st = st.lists(st.integers(1, 60), min_size=1, max_size=4)
shares_st = st.integers(2, 5).flatmap(lambda d: st.lists(st.integers(1, 6), min_size=d, max_size=d))


def layouts(lengths, shares, t=1) -> list[MicrobatchLayout]:
    return [MicrobatchLayout(tuple(range(len(lengths))), tuple(lengths), len(shares), r, t, tuple(shares))
            for r in range(len(shares))]


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, shares=shares_st, t=st.integers(1, 4))
def test_every_token_is_held_once_in_chunks_cut_by_the_plans_rule(lengths, shares, t):
    group = layouts(lengths, shares, t)
    for i, n in enumerate(lengths):
        chunks = shard_chunks(n, shares, t)
        padded = group[0].padded_lengths[i]
        assert padded == 2 * sum(chunks) >= n
        held = [layout.sample_positions(i) for layout in group]
        assert sorted(torch.cat(held).tolist()) == list(range(padded))
        offset = 0
        for r, (layout, positions) in enumerate(zip(group, held)):
            c = chunks[r]
            assert layout.local_lengths[i] == 2 * c and (2 * c) % t == 0  # sequence parallelism splits it
            assert positions.tolist() == [*range(offset, offset + c), *range(padded - offset - c, padded - offset)]
            offset += c
    assert [layout.num_slots for layout in group] == list(group[0].rank_slots)
    assert sum(int(layout.real().sum()) for layout in group) == sum(lengths)
    positions, segments = host_group_rows(group[0])
    assert torch.equal(positions, torch.cat([layout.local_positions for layout in group]))
    assert torch.equal(segments, torch.cat([layout.segments for layout in group]))


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 80), shares=shares_st, t=st.integers(1, 3))
def test_equal_chunks_are_the_even_zigzag(length, shares, t):
    chunks = shard_chunks(length, shares, t)
    if len(set(chunks)) > 1:
        return
    for layout in layouts([length], shares, t):
        assert torch.equal(layout.local_positions, zigzag_positions(length, len(shares), layout.rank, t))


def test_equal_shares_in_a_plan_lay_out_as_even_shards():
    even = PlanGroup((2, 0, 1), ((0, 1),))
    equal = PlanGroup((2, 0, 1), ((0, 1),), shares=(3, 3, 3))
    assert equal.sorted_shares == () and equal == even
    for r in range(3):
        assert group_layout(equal, 0, r, {0: 13, 1: 40}, 2, None) == group_layout(even, 0, r, {0: 13, 1: 40}, 2, None)


def test_a_group_lays_out_its_shares_in_sorted_rank_order():
    group = PlanGroup((3, 1), ((0,),), shares=(1, 3))  # rank 3 holds one part, rank 1 three
    first, second = (group_layout(group, 0, r, {0: 32}, 1, None) for r in range(2))
    assert (first.num_slots, second.num_slots) == (24, 8) and first.shares == (3, 1)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, shares=shares_st, t=st.integers(1, 3), steps=st.integers(0, 3))
def test_slot_rows_pad_every_rank_to_the_same_rows(lengths, shares, t, steps):
    base = layouts(lengths, shares, t)
    rows = -(-max(base[0].rank_slots) // base[0].row_multiple) * base[0].row_multiple + steps * base[0].row_multiple
    padded = [layout.with_rows(rows) for layout in base]
    assert {layout.num_slots for layout in padded} == {rows}
    assert padded[0].padded_lengths[:-1] == base[0].padded_lengths[:-1]
    for i in range(len(lengths)):
        held = torch.cat([layout.sample_positions(i) for layout in padded])
        assert sorted(held.tolist()) == list(range(padded[0].padded_lengths[i]))
    assert sum(int(layout.real().sum()) for layout in padded) == sum(lengths)


def test_aligned_slot_rows_cover_the_fullest_rank_of_an_uneven_group():
    plan = uneven_workers.plans_of_four()["2+2 non-contiguous, then 4"]
    rows = aligned_slot_rows(plan, 2)
    lengths = {s.id: s.tokens for s in plan.samples}
    spreads = []
    for group in plan.groups:
        for k in range(len(group.microbatches)):
            needed = group_layout(group, k, 0, lengths, 2, None).rank_slots
            assert rows[group.phase][k] >= max(needed)
            spreads.append(max(needed) - min(needed))
            for r in range(group.size):  # each rank pads up to them
                assert group_layout(group, k, r, lengths, 2, rows).num_slots == rows[group.phase][k]
    assert max(spreads) > 0


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, shares=shares_st)
def test_zigzag_pack_and_unpack_follow_uneven_chunks(lengths, shares):
    group = layouts(lengths, shares)
    chunks = [group[0].chunks(i) for i in range(len(lengths))]
    cu = group[0].cu_seqlens
    x = torch.randn(sum(lengths), 3)
    shards = zigzag_pack(x, cu, len(shares), None, -1.0, chunks=chunks)
    positions = torch.cat([layout.local_positions for layout in group])
    starts = torch.cat([torch.repeat_interleave(cu[:-1].long(), torch.tensor(layout.local_lengths)) for layout in group])
    real = torch.cat([layout.real() for layout in group])
    assert torch.equal(shards[real], x[(starts + positions)[real]]) and bool((shards[~real] == -1).all())
    assert torch.equal(zigzag_unpack(shards, cu, len(shares), None, chunks=chunks), x)
    for layout in group:
        own = zigzag_pack(x, cu, len(shares), layout.rank, chunks=chunks)
        assert own.shape[0] == layout.num_slots


def answers_against_the_mask(backend: str, shares: tuple[int, ...], device: str = "cpu",
                             dtype: torch.dtype = torch.float64) -> list[float]:
    """All-gather (every rank's rows, rank-major) and the ring's merged blocks of every source, for each rank's
    queries: their largest difference from attention under the causal mask of true positions (fp64), relative
    to the largest output (forward; the gradients run in the distributed checks)."""
    group = layouts((37, 2, 90, 11), shares)
    metas = [AttentionMeta.build(layout, device) for layout in group]
    gen = torch.Generator().manual_seed(3)
    qs, ks, vs = ([torch.randn(layout.num_slots, n, 16, generator=gen, dtype=torch.float64) for layout in group]
                  for n in (4, 2, 2))
    positions, segments = host_group_rows(group[0])
    kern, d, diffs = kernel(backend), len(shares), []
    on = [[x.to(device, dtype) for x in xs] for xs in (qs, ks, vs)]
    with torch.no_grad():
        for r, meta in enumerate(metas):
            assert all(torch.equal(a.cpu(), b) for a, b in zip(meta.group_rows(), (positions, segments)))
            assert [meta.ring_rows(step) for step in range(d - 1)] == [group[(r - step - 1) % d].num_slots
                                                                       for step in range(d - 1)]
            mask = visible(group[r].local_positions, positions, group[r].segments, segments)
            want = block_attention(qs[r], torch.cat(ks), torch.cat(vs), mask, 0.3)[0]
            got = [kern.gathered(on[0][r], torch.cat(on[1]), torch.cat(on[2]), meta, 0.3),
                   merged_blocks(on[0][r], [(meta.ring_block(step), on[1][s], on[2][s])
                                            for step, s in enumerate((r - step) % d for step in range(d))],
                                 kern, meta, 0.3)[0]]
            diffs += [float((x.double().cpu() - want).abs().max() / want.abs().max()) for x in got]
    return diffs


@pytest.mark.parametrize(("backend", "shares"), [(backend, shares) for backend in ("math", "sdpa")
                                                  for shares in ((3, 1), (1, 4, 2), (2, 5, 1, 3))]
                         + [("flex", (1, 4, 2))])  # flex's CPU forward is slow to start: one group
def test_every_kernel_answers_uneven_blocks_as_the_causal_mask(backend, shares):
    assert max(answers_against_the_mask(backend, shares)) < 1e-12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("backend", "dtype"), [("varlen", torch.bfloat16), ("flex", torch.float32)])
@pytest.mark.parametrize("shares", [(3, 1), (2, 5, 1, 3)])
def test_gpu_kernels_answer_uneven_blocks_as_the_causal_mask(backend, dtype, shares):
    assert max(answers_against_the_mask(backend, shares, "cuda", dtype)) <= 2e-2


def test_ulysses_unpacks_the_group_rows_of_uneven_shards_to_whole_samples():
    group = layouts((37, 2, 90, 11), (2, 5, 1))
    meta = AttentionMeta.build(group[1])
    rows = torch.cat([layout.local_positions + 1000 * layout.segments for layout in group]).double()[:, None]
    natural = meta.zigzag.unpack(rows)
    want = torch.cat([torch.arange(n) + 1000 * i for i, n in enumerate(group[0].padded_lengths)]).double()[:, None]
    assert torch.equal(natural, want) and torch.equal(meta.zigzag.pack(natural), rows)


def test_rope_goes_by_position_under_uneven_shards_even_where_fusion_is_on(monkeypatch):
    """megatron's fused THD RoPE finds shards as padded / d; an uneven microbatch never reaches it."""
    from types import SimpleNamespace

    monkeypatch.setattr(rope, "_ORIGINAL", lambda *a, **k: pytest.fail("megatron's RoPE got an uneven microbatch"))
    config = SimpleNamespace(apply_rope_fusion=True, rotary_interleaved=False, multi_latent_attention=False)
    layout = layouts((10,), (1, 3))[1]
    t, freqs = torch.randn(layout.num_slots, 2, 8), torch.randn(32, 1, 1, 8)
    group = rope.DynamicRopeGroup(None, layout.local_positions, uneven=True)
    out = rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=layout.cu_seqlens, cp_group=group)
    config.apply_rope_fusion = False
    assert torch.equal(out, rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=layout.cu_seqlens, cp_group=group))


def test_transformer_engines_attention_refuses_uneven_shares_before_the_step():
    plan = uneven_workers.plans_of_four()["2+2 non-contiguous, then 4"]
    te = CommPolicy.resolve("allgather", layer_spec="te", world_size=4, gpus_per_node=4)
    with pytest.raises(DhpError, match=r"layer_spec te.*uneven_shards: false"):
        check_shares(plan, te)
    check_shares(plan, CommPolicy.resolve("allgather", world_size=4, gpus_per_node=4))
    check_shares(replace(plan, groups=tuple(replace(g, shares=()) for g in plan.groups)), te)


def test_the_missized_view_keeps_rank_zeros_rows_and_the_padding():
    """What the mis-sized run relies on to complete: rank 0's own rows and every padded length unchanged, the
    other ranks' chunks moved."""
    plan = uneven_workers.missized_plan()
    lengths = {s.id: s.tokens for s in plan.samples}
    group = plan.groups[0]
    for k in range(len(group.microbatches)):
        right = group_layout(group, k, 0, lengths, 1, None)
        wrong = uneven_workers.missized(right)
        assert wrong.local_lengths == right.local_lengths and wrong.padded_lengths == right.padded_lengths
        assert wrong.rank_slots != right.rank_slots


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return launch(uneven_workers.uneven_checks, 4, timeout_s=600)


@pytest.mark.parametrize("comm", COMM_VARIANTS)
@pytest.mark.parametrize("plan", list(uneven_workers.plans_of_four()))
def test_loss_and_every_gradient_match_one_process_on_uneven_groups(four, plan, comm):
    sizes = {g.size for p in uneven_workers.plans_of_four().values() for g in p.groups if g.shares}
    assert sizes == {2, 3, 4}
    for rank in four:
        assert_exact(rank["exact"][(plan, comm)])


def test_ulysses_with_fewer_heads_than_ranks_on_uneven_groups(four):
    for rank in four:
        assert_exact(rank["two_heads"])


def test_moe_allgather_dispatcher_pads_uneven_slots_to_equal_rows(four):
    for rank in four:
        for result in rank["moe_allgather"].values():
            assert_exact(result)


def test_multi_token_prediction_rolls_over_uneven_shards(four):
    for rank in four:
        assert_exact(rank["mtp"])


def test_vision_rows_follow_uneven_shards(four):
    for rank in four:
        for result in rank["vlm"].values():
            assert_exact(result)


def test_a_rank_that_missizes_the_shares_makes_the_check_fail(four):
    """The same plan, rank 0 mistaking two peers' shares in its attention metadata: it runs to the end, and loss
    and gradients leave the tolerance by orders of magnitude."""
    for rank in four:
        assert_exact(rank["missized_exact"])
        wrong = rank["missized"]
        # relative to the oracle's loss and largest gradient: 3.8e-3 and 0.38 measured, a few ulps when right
        assert wrong.max_loss_diff > 100 * RELATIVE and wrong.max_grad_diff > 100 * RELATIVE, wrong
        assert not wrong.ok


def test_a_layer_on_uneven_shards_issues_no_host_sync(four):
    for rank in four:
        assert rank["host_syncs"] == dict.fromkeys(COMM_VARIANTS), rank["host_syncs"]


@pytest.mark.parametrize("comm", COMM_VARIANTS)
def test_sequence_parallel_uneven_groups_match_one_process(sequence_parallel, comm):
    for rank in sequence_parallel:
        assert rank["sp"] == (2, True)
        assert_exact(rank["exact"][comm])


@pytest.fixture(scope="module")
def sequence_parallel() -> list[dict]:
    return launch(uneven_workers.sequence_parallel_checks, 4, timeout_s=400)


def test_pipeline_parallel_uneven_groups_match_one_process():
    for rank in launch(uneven_workers.pipeline_checks, 4, timeout_s=400):
        for result in rank["exact"].values():
            assert_exact(result)
