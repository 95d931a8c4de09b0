"""RoPE by position on a dynamic group: megatron-core's own THD rotation, bit for bit, and every option a later
megatron-core passes (0.19's `mla_rotary_interleaved`, 0.20's `inverse`, `max_seqlen`, ...) handed on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_dhp.runtime import rope


class OneRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def inputs(mla: bool = False):
    torch.manual_seed(0)
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=mla,
                             mrope_section=None)
    lengths = [5, 3, 8]
    t = torch.randn(sum(lengths), 2, 8)
    freqs = torch.randn(32, 1, 1, 8)  # positions up to 32 (not one per packed row: megatron would offset them)
    cu_seqlens = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return t, freqs, config, cu_seqlens, rope.DynamicRopeGroup(None, positions)


@pytest.mark.parametrize("mla", [False, True])
def test_rows_rotated_by_position_equal_megatrons_thd_rope(mla):
    t, freqs, config, cu_seqlens, group = inputs(mla)
    want = rope._ORIGINAL(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=OneRank())
    assert torch.equal(rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=group), want)


def test_options_of_later_megatron_cores_reach_megatron_and_the_dynamic_path(monkeypatch):
    t, freqs, config, cu_seqlens, group = inputs()
    megatrons = rope._ORIGINAL
    seen = {}
    monkeypatch.setattr(rope, "_ORIGINAL", lambda *a, **k: seen.update(k) or "megatron's")
    out = rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=OneRank(), max_seqlen=8,
                                    mla_rotary_interleaved=False)
    assert out == "megatron's" and seen["max_seqlen"] == 8 and seen["mla_rotary_interleaved"] is False
    # on the dynamic path an option the row-wise rotation does not take (max_seqlen) is not an error
    plain = rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=group)
    assert torch.equal(rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=group,
                                                 max_seqlen=8), plain)
    if "mla_rotary_interleaved" not in rope._APPLY_OPTIONS:
        return  # before 0.19 the config alone decides MLA's interleaving (the parametrized test above)
    # from 0.19 on, MLA's interleaving asked for by the caller (as its MLA module does) is what the rotation does
    interleaved = rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=group,
                                            mla_rotary_interleaved=True)
    assert torch.equal(interleaved, megatrons(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=OneRank(),
                                              mla_rotary_interleaved=True))
    assert not torch.equal(interleaved, plain)


def test_the_dynamic_path_issues_no_host_sync_where_megatrons_thd_rope_does():
    """Per layer on a GPU: the row-wise rotation enqueues kernels only (the option handling is host-side Python on
    arguments); megatron's THD RoPE reads `cu_seqlens` on the host, which the guard catches."""
    from megatron_dhp.testing.host_sync import HostSyncError, NoHostSync

    t, freqs, config, cu_seqlens, group = inputs()
    with NoHostSync():
        rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=group, max_seqlen=8)
    with pytest.raises(HostSyncError), NoHostSync():
        rope._ORIGINAL(t, freqs, config, cu_seqlens=cu_seqlens, cp_group=OneRank())
