"""Named NVTX ranges around a step's host work, so an Nsight Systems timeline shows where a step waited on dhp.

Three stretches of a step run on the host between the model's kernels and are invisible on the GPU's rows of a
timeline: waiting for the plan (its solve, when read-ahead did not hide it, and its broadcast), moving the
tokens to the ranks of their groups, and building each microbatch's attention metadata. Each runs inside
`nvtx_range(label)` with one of the labels below. Without CUDA the range is a no-op (torch's NVTX calls need a
CUDA build); a test counts the ranges by patching `torch.cuda.nvtx` and `enabled`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

PLAN_WAIT = "dhp/plan-wait"
"""`StepEngine._plan`: the step's plan solved (or awaited from the background) on rank 0 and broadcast."""
MOVE_TOKENS = "dhp/move-tokens"
"""`StepEngine._dispatch`: the tokens (and a multimodal batch's pixels) moved to the ranks that run them."""
METADATA = "dhp/attention-metadata"
"""`CPContext`: one microbatch's attention metadata built on the host and copied to the device."""
LABELS: tuple[str, ...] = (PLAN_WAIT, MOVE_TOKENS, METADATA)


@functools.cache
def enabled() -> bool:
    """Whether ranges are pushed: CUDA is available (asked once; the answer does not change in a process)."""
    return torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(label: str) -> Iterator[None]:
    """The block inside an NVTX range named `label` where CUDA is available; nothing otherwise."""
    if not enabled():
        yield
        return
    torch.cuda.nvtx.range_push(label)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
