"""bench/attention_overhead.py's after side on one tiny case: every variant runs on meta tensors under the
stubbed collectives (and fused SDPA) and reports a positive host time, and the stubs are gone afterwards. The
before side (revision 457d665 in a worktree) is left to the bench itself: it takes minutes."""

from __future__ import annotations

import math

import torch

from megatron_dhp.runtime.attention import allgather, comm, ring, ulysses
from tests.bench_scripts import load_bench

overhead = load_bench("attention_overhead")


def test_sample_lengths_are_long_tailed_and_sum_to_the_tokens():
    for total in (2048, 8192, 131072):
        lengths = overhead.sample_lengths(total)
        assert sum(lengths) == total and lengths[:3] == (total // 4, total // 8, total // 8)
        assert all(64 <= n <= 1024 + 63 for n in lengths[3:]) and len(lengths) > 4
    assert overhead.sample_lengths(8192) == overhead.sample_lengths(8192)


def test_after_side_times_every_variant_on_meta_and_restores_the_collectives():
    def current():
        return (comm.start_shift, ring.start_shift, allgather.all_gather, ulysses.all_to_all,
                torch.nn.functional.scaled_dot_product_attention)

    originals = current()
    args = overhead.parse_args(["--side", "after", "--tokens", "2048", "--groups", "1,2", "--repeats", "2",
                                "--budget", "0.5", "--limit", "60"])
    rows = overhead.measure_side("after", args)
    assert [(r.group, r.variant) for r in rows] == [(1, "local")] + [(2, c) for c in overhead.VARIANTS]
    for row in rows:
        assert row.samples == len(overhead.sample_lengths(2048))
        assert math.isfinite(row.build_ms) and row.build_ms > 0, row
        assert set(row.timings) == {"varlen", "sdpa"}, row
        for timing in row.timings.values():
            assert not timing.timed_out and len(timing.calls_ms) >= 2 and timing.ops > 0, row
            assert math.isfinite(timing.ms) and timing.ms > 0, row
    assert current() == originals
    records = overhead.merged([], rows, args)  # no before side: ratios are None, the rest is carried
    assert all(r["before"] is None and r["before_over_varlen"] is None for r in records)
    assert records[1]["after_varlen"]["ms"] == rows[1].timings["varlen"].ms


def test_fused_sdpa_has_torch_sdpa_shapes_and_gradients_on_meta():
    q = torch.empty(4, 8, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(4, 12, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    mask = torch.ones(8, 12, dtype=torch.bool, device="meta")
    for kwargs in ({"attn_mask": mask}, {"is_causal": True}):
        out = overhead.fused_sdpa(q, k, k, scale=0.25, **kwargs)
        assert out.shape == torch.nn.functional.scaled_dot_product_attention(q, k, k, **kwargs).shape
        out.backward(torch.empty_like(out))
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
