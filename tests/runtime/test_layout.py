"""Zigzag THD layout: pure index math, checked against its definition (no process group)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.runtime.layout import MicrobatchLayout, padded_length, zigzag_positions
from megatron_dhp.testing.virtual_group import host_group_rows


@given(length=st.integers(1, 300), d=st.integers(1, 9))
def test_zigzag_covers_every_position_once(length, d):
    held = [zigzag_positions(length, d, r) for r in range(d)]
    padded = padded_length(length, d)
    assert padded % (1 if d == 1 else 2 * d) == 0 and padded - length < (1 if d == 1 else 2 * d)
    assert sorted(torch.cat(held).tolist()) == list(range(padded))
    assert {h.numel() for h in held} == {padded // d}
    # every real token once; padding only at the end of the sample
    real = torch.cat([h[h < length] for h in held])
    assert sorted(real.tolist()) == list(range(length))


def test_zigzag_chunks_are_r_and_mirror():
    # L = 10 on d = 3: padded to 12, chunks of 2; rank 0 keeps chunks 0 and 5, rank 2 keeps 2 and 3
    assert zigzag_positions(10, 3, 0).tolist() == [0, 1, 10, 11]
    assert zigzag_positions(10, 3, 1).tolist() == [2, 3, 8, 9]
    assert zigzag_positions(10, 3, 2).tolist() == [4, 5, 6, 7]
    assert zigzag_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


def test_microbatch_layout_fields():
    layout = MicrobatchLayout(sample_ids=(7, 3), lengths=(5, 10), group_size=3, rank=1)
    assert layout.padded_lengths == (6, 12) and layout.local_lengths == (2, 4) and layout.num_slots == 6
    assert layout.cu_seqlens.tolist() == [0, 5, 15]
    assert layout.cu_seqlens_padded.tolist() == [0, 6, 18]
    assert layout.local_cu_seqlens.tolist() == [0, 2, 6]
    assert layout.max_seqlen == 12
    assert layout.local_positions.tolist() == [1, 4, 2, 3, 8, 9]
    assert layout.segments.tolist() == [0, 0, 1, 1, 1, 1]
    assert layout.real().tolist() == [True] * 6
    assert layout.real(rank=0).tolist() == [True, False, True, True, False, False]
    positions, segments = host_group_rows(layout)
    assert positions.tolist()[:6] == [0, 5, 0, 1, 10, 11] and segments.numel() == 18


def test_one_rank_group_is_unpadded():
    layout = MicrobatchLayout(sample_ids=(0, 1), lengths=(3, 4), group_size=1, rank=0)
    assert layout.num_slots == 7 and bool(layout.real().all())
    assert layout.local_positions.tolist() == [0, 1, 2, 0, 1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), d=st.integers(1, 4), t=st.integers(1, 3),
       steps=st.integers(0, 5))
def test_extra_rows_pad_the_last_sample_and_keep_every_token_once(lengths, d, t, steps):
    base = MicrobatchLayout(tuple(range(len(lengths))), tuple(lengths), d, 0, seq_multiple=t)
    rows = base.num_slots + steps * base.row_multiple
    layouts = [MicrobatchLayout(base.sample_ids, base.lengths, d, r, seq_multiple=t).with_rows(rows) for r in range(d)]
    assert {layout.num_slots for layout in layouts} == {rows} and rows % t == 0
    assert layouts[0].padded_lengths[:-1] == base.padded_lengths[:-1]
    for i, n in enumerate(lengths):
        held = torch.cat([layout.sample_positions(i) for layout in layouts])
        assert sorted(held.tolist()) == list(range(layouts[0].padded_lengths[i]))
        assert sorted(held[held < n].tolist()) == list(range(n))
    assert sum(int(layout.real().sum()) for layout in layouts) == sum(lengths)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), d=st.integers(1, 4), t=st.integers(1, 3),
       steps=st.integers(0, 2))
def test_thd_parameters_state_padding_and_hold_no_empty_sequence(lengths, d, t, steps):
    """What TransformerEngine receives: every sequence non-empty, true and padded (its fused RoPE slows on empty
    ones), `pad_between_seqs` exactly when some sample is padded (tail padding too), and one tensor for both
    lengths when none is (TE 2.18 treats separate tensors as padded)."""
    from megatron_dhp.runtime.attention.context import CPContext, DhpPackedSeqParams

    base = MicrobatchLayout(tuple(range(len(lengths))), tuple(lengths), d, d - 1, seq_multiple=t)
    layout = base.with_rows(base.num_slots + steps * base.row_multiple)
    group = SimpleNamespace(size=lambda: d, rank=lambda: d - 1) if d > 1 else None  # what a CPContext asks of it
    params = DhpPackedSeqParams.for_microbatch(CPContext(layout, group))
    true, padded = params.cu_seqlens_q, params.cu_seqlens_q_padded
    assert bool((true.diff() >= 1).all()) and bool((padded.diff() >= 1).all())
    assert params.pad_between_seqs == (not torch.equal(true, padded))
    assert params.pad_between_seqs or padded is true
    assert params.cu_seqlens_kv is true and params.cu_seqlens_kv_padded is padded


def test_a_zero_length_sample_never_makes_a_layout():
    import pytest

    with pytest.raises(AssertionError, match="at least one token"):
        MicrobatchLayout((0, 1), (5, 0), 1, 0)
