"""What a Megatron-LM run with --dhp holds for its whole life: the domain, its group pool and the planner.

Megatron calls the schedule through a fixed signature, so the schedule finds these the way Megatron's own
code finds its arguments: one process-wide object, set once by `setup` on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.integration.planning import StepPlanner
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.group_pool import GroupPool


@dataclass(frozen=True)
class DhpRuntime:
    """This rank's dynamic domain and everything that plans and runs its steps."""

    config: DhpConfig
    domain: DynamicDomain
    pool: GroupPool
    planner: StepPlanner
    tp_group: dist.ProcessGroup | None
    """The tensor-parallel group when TP > 1: its ranks share one loader (on TP rank 0) and one slice of data."""
    tp_source: int
    """Global rank of tensor-parallel rank 0, the one that reads the loader."""
    split_documents: bool
    """Train each document of a loader row as its own sequence (Megatron's --reset-attention-mask)."""
    max_sample_tokens: int | None
    """Cut longer sequences to this many tokens (the domain's capacity, when `truncate` is set)."""


_RUNTIME: DhpRuntime | None = None


def set_runtime(runtime: DhpRuntime | None) -> None:
    """Install (or, with None, forget) the process-wide runtime."""
    global _RUNTIME
    _RUNTIME = runtime


def get_runtime() -> DhpRuntime:
    """The runtime `setup` installed; a clear error if it never ran."""
    if _RUNTIME is None:
        raise DhpError(
            "megatron-dhp is not set up: call megatron_dhp.megatron.setup(args, train, valid, test) on every rank "
            "once the data iterators exist (the patches in patches/ do this in pretrain())"
        )
    return _RUNTIME
