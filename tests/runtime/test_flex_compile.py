"""FlexAttention is compiled a bounded number of times whatever the plan (`runtime.attention.flex`).

On a GPU flex is compiled; past dynamo's recompile limit (8 compilations of one function) dynamo runs it
eagerly, which for FlexAttention is dense attention (128 GiB of scores at 32K tokens x 32 heads). The CPU
runs flex eagerly, so here it is compiled with the `aot_eager` backend, which traces and guards as on a GPU:
every question flex answers (causal, all-gather, each ring step, the ring's also in grad mode as its backward
recomputes it), for every group size and rank of a ring of 1 to 3 and microbatches of different sample counts
and lengths, in the order a run meets them."""

from __future__ import annotations

import pytest
import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention import flex
from megatron_dhp.runtime.attention.meta import AttentionMeta
from megatron_dhp.runtime.layout import MicrobatchLayout

pytestmark = pytest.mark.slow  # each question compiled: about a minute of CPU

BATCHES = ((40, 17, 3), (64,), (5, 33, 21, 12, 9), (100, 28))
"""Microbatches of different sample counts and lengths (one sample, several, long and short)."""


def every_question(kernel: flex.FlexKernel) -> None:
    """Each group size, rank and microbatch: causal (a group of one), the all-gather's rows, every ring step."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for d in (1, 2, 3):
            for lengths in BATCHES:
                for r in range(d):
                    meta = AttentionMeta.build(MicrobatchLayout(tuple(range(len(lengths))), lengths, d, r))
                    t = meta.local.total
                    q, k, v = (torch.randn(t, 4, 16, generator=gen) for _ in range(3))
                    if d == 1:
                        kernel.causal(q, k, v, meta.local, 0.25)
                        continue
                    rows = meta.group_rows()[0].numel()
                    kernel.gathered(q, *(torch.randn(rows, 2, 16, generator=gen) for _ in range(2)), meta, 0.25)
                    for step in range(d):
                        block = meta.ring_block(step)
                        kv = [torch.randn(block.keys.spans.total, 2, 16, generator=gen) for _ in range(2)]
                        kernel.block(q, *kv, block, meta, 0.25)
                        with torch.enable_grad():  # the backward's recompute runs in grad mode (on a GPU only:
                            flex._attend(q, *kv, flex._ring_mask(block, meta), 0.25, block.kind)  # no leaves here)


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    torch._dynamo.reset()
    flex._compiled.cache_clear()
    monkeypatch.setitem(flex.COMPILE_BACKEND, "cpu", "aot_eager")
    yield
    torch._dynamo.reset()
    getattr(flex._compiled, "cache_clear", lambda: None)()


def test_each_question_compiles_within_the_limit(compiled_on_cpu):
    every_question(flex.FlexKernel())
    compiled = flex._compiled.cache_info().currsize
    # an attention function per question and grad mode (the ring steps' in both), a mask builder per question
    assert compiled == len(flex.QUESTIONS) + len(flex.RING_BLOCKS) + len(flex.QUESTIONS)


def test_one_function_for_every_question_passes_the_limit_and_is_refused(compiled_on_cpu, monkeypatch):
    # What flex did before: one compiled flex_attention for every mask. Past the limit it now fails with a
    # line (before, dynamo fell back to dense eager attention without a word).
    build = flex._compiled.__wrapped__
    one = build(flex._flex_call, "flex_every_question", "aot_eager")
    monkeypatch.setattr(flex, "_compiled", lambda body, name, backend: one if body is flex._flex_call else
                        build(body, name, None))
    with pytest.raises(DhpError, match="flex_every_question was compiled for 8 shapes and would now run eagerly"):
        every_question(flex.FlexKernel())
