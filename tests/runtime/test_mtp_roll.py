"""Multi-token prediction's roll on megatron-dhp's layout: every rank's slot takes the value of its sample's
next position, across chunk and rank boundaries, for any group size (all ranks simulated in one process)."""

from __future__ import annotations

import pytest
import torch

from megatron_dhp.runtime.attention.meta import AttentionMeta
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.runtime.mtp import chunk_firsts, rolled


@pytest.mark.parametrize("seq_multiple", [1, 2])
@pytest.mark.parametrize("group_size", [1, 2, 3, 5])
def test_every_slot_takes_its_samples_next_position(group_size, seq_multiple):
    lengths = (7, 1, 30, 12)
    gen = torch.Generator().manual_seed(group_size)
    layouts = [MicrobatchLayout(tuple(range(len(lengths))), lengths, group_size, r, seq_multiple)
               for r in range(group_size)]
    padded = layouts[0].padded_lengths
    values = [torch.randint(1, 1000, (n,), generator=gen) for n in padded]  # padding slots hold values too
    local = [torch.cat([values[i][layout.sample_positions(i)] for i in range(len(lengths))])[None]
             for layout in layouts]
    cus = [AttentionMeta.build(layout).local.cu for layout in layouts]  # what a microbatch's metadata holds
    firsts = [chunk_firsts(x, cu) for x, cu in zip(local, cus)]
    for r, (x, layout) in enumerate(zip(local, layouts)):
        nxt, prev = firsts[(r + 1) % group_size][0], firsts[(r - 1) % group_size][1]
        out = rolled(x, layout, cus[r], nxt, prev)
        expected = torch.cat([
            torch.tensor([int(values[i][p + 1]) if p + 1 < padded[i] else 0 for p in layout.sample_positions(i).tolist()])
            for i in range(len(lengths))
        ])[None]
        assert torch.equal(out, expected), (r, out, expected)


def test_the_roll_reads_the_microbatchs_device_metadata_not_the_host_layout(monkeypatch):
    # Inside the model's forward the roll must not copy host tensors to the device (a pageable copy makes a
    # GPU wait): it reads the cumulative lengths the microbatch's metadata already moved there.
    from megatron_dhp.runtime.attention.context import CPContext
    from megatron_dhp.runtime.mtp import roll_left
    from megatron_dhp.testing.host_sync import NoHostSync

    layout = MicrobatchLayout((0, 1, 2), (5, 1, 9), 1, 0)
    ctx = CPContext(layout, None)
    x = torch.arange(1, 16)[None]
    want = rolled(x, layout, ctx.meta.local.cu)

    def host_read(self):
        raise AssertionError("the roll read the layout's host tensor")

    monkeypatch.setattr(MicrobatchLayout, "local_cu_seqlens", property(host_read))
    with NoHostSync():  # nor anything else that makes a GPU wait
        got = roll_left(x, ctx)
    assert torch.equal(got, want)
    assert want[0].tolist() == [2, 3, 4, 5, 0, 0, 8, 9, 10, 11, 12, 13, 14, 15, 0]
