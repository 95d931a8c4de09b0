"""What a Megatron-LM run with --dhp holds for its whole life: the domain, its group pool and the planner.

Megatron calls the schedule through a fixed signature, but it does hand the schedule the data iterator:
`setup` builds one `DhpRuntime` per rank and gives it to the iterators it returns, and the schedule takes
it from there. Nothing is process-wide: each iterator plans and runs with the runtime it was built with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron_dhp.integration.step_runtime import StepRuntime


@dataclass(frozen=True)
class DhpRuntime:
    """This rank's step runtime (domain, comm policy, planner, group pool) and how it reads Megatron's loader."""

    steps: StepRuntime
    share_group: dist.ProcessGroup | None
    """The model-parallel group (TP x PP) when it has more than one rank: its ranks train on the same tokens,
    which one of them reads from the loader and broadcasts."""
    share_source: int
    """Global rank of the one that reads the loader: tensor-parallel rank 0 of the first pipeline stage."""
    split_documents: bool
    """Train each document of a loader row as its own sequence (Megatron's --reset-attention-mask)."""
    max_sample_tokens: int | None
    """Cut longer sequences to this many tokens (the domain's capacity, when `truncate` is set)."""
