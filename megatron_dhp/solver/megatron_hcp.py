"""megatron-core's hybrid context parallel scheduler as a planner (`megatron-hcp`).

Upstream's `BalancedCPScheduler` (megatron/core/pipeline_parallel/hybrid_cp_schedule.py) is called through
its public class on (sample id, length) pairs. It returns successive *sets*, each a per-rank list of sample
ids; a sample listed on several ranks runs as CP over exactly those ranks, every sample is its own
microbatch, and upstream's schedule barriers the whole DP x CP group between sets. Each set becomes one phase
of the plan and the plan sets `phase_barrier`.

What upstream cannot run is reported, not patched: an odd domain (`parallel_state` asserts an even DP x CP
size), a sample whose power-of-two group is larger than the domain, an error raised inside the scheduler,
or a group for which `parallel_state.create_hybrid_dp_cp_groups` makes no process group all raise
`PlannerUnsupported`. Upstream creates aligned blocks of 2, 4, ..., 2**(floor(log2 N) - 1) ranks plus the
whole domain, so a non-power-of-two N (e.g. 48: no 32-rank groups) loses the batches that need the missing
sizes, while a power-of-two N plans every batch that fits N x M.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.solver.base import Planner, PlannerUnsupported
from megatron_dhp.workload.sample import Batch

# What the scheduler raises when it cannot place a batch (its own asserts, or indexing past the domain
# while it widens groups onto free ranks); anything else is a bug on our side and propagates.
_UPSTREAM_FAILURES = (AssertionError, IndexError, KeyError)


@dataclass(frozen=True)
class _DomainSize:
    """Stands in for the DP x CP process group: the scheduler only calls `.size()`."""

    world_size: int

    def size(self) -> int:
        return self.world_size


def upstream_group_sizes(world_size: int) -> set[int]:
    """Group sizes megatron-core has process groups for: 1 (no group needed), 2 .. 2**(floor(log2 N)-1), N."""
    return {1, world_size} | {2**i for i in range(1, int(math.log2(world_size)))}


@dataclass
class MegatronHCPPlanner(Planner):
    """megatron-core's `BalancedCPScheduler`; its successive group sets become barrier-separated phases."""

    name: str = "megatron-hcp"
    phase_barrier: ClassVar[bool] = True
    _scheduler_cls: type = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # megatron.core takes seconds to import: pay that once here rather than inside a timed solve.
        # Its warnings about missing TransformerEngine/apex say nothing about planning.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

        self._scheduler_cls = BalancedCPScheduler

    def solve(self, batch: Batch, model: CostModel) -> list[PlanGroup]:
        """Run upstream's scheduler on (id, length) pairs and convert its sets to phases."""
        domain = model.domain
        n = domain.world_size
        if n % 2:
            raise PlannerUnsupported(
                f"megatron-core's hybrid CP needs an even number of DP x CP ranks (parallel_state asserts it); "
                f"the domain has {n}"
            )
        # Upstream sizes groups by tokens; encoder memory, where it counts, joins them (`Footprint.linear`).
        footprint = model.footprint(batch.samples)
        memory = dict(zip((s.id for s in batch.samples), footprint.linear(n).tolist()))
        scheduler = self._scheduler_cls(footprint.cap, _DomainSize(n))
        longest = max(batch.samples, key=lambda s: (memory[s.id], -s.id))
        need = scheduler.gpus_needed(memory[longest.id])
        if need > n:
            raise PlannerUnsupported(
                f"upstream cannot plan this batch: sample {longest.id} ({memory[longest.id]} tokens) needs a "
                f"power-of-two CP group of {need} ranks of {footprint.cap} tokens, but the domain has {n}"
            )
        try:
            _, sets = scheduler.get_groups_and_subsamples([(s.id, memory[s.id]) for s in batch.samples], None)
        except _UPSTREAM_FAILURES as e:
            raise PlannerUnsupported(
                f"upstream cannot plan this batch on {n} ranks: BalancedCPScheduler raised "
                f"{type(e).__name__}: {str(e).strip() or 'no message'}"
            ) from e
        legal = upstream_group_sizes(n)
        return [g for phase, per_rank in enumerate(sets) for g in set_to_groups(per_rank, phase, legal)]


def set_to_groups(per_rank: list[list[int]], phase: int, legal_sizes: set[int]) -> list[PlanGroup]:
    """The CP groups of one upstream set: the ranks that list a sample run it together, in their order.

    Every sample of a group must be listed by exactly the group's ranks, in the same order on each (else
    upstream's ranks would wait on each other forever), and the group must be one of upstream's process
    groups: an aligned block of a size in `legal_sizes`. A rank listing nothing sits the phase out.
    """
    ranks_of: dict[int, list[int]] = {}
    for rank, ids in enumerate(per_rank):
        for sid in ids:
            ranks_of.setdefault(sid, []).append(rank)
    groups: list[PlanGroup] = []
    placed: set[int] = set()
    for rank, ids in enumerate(per_rank):
        if not ids or rank in placed:
            continue
        members = ranks_of[ids[0]]
        if any(ranks_of[sid] != members for sid in ids) or any(per_rank[q] != ids for q in members):
            raise PlannerUnsupported(
                f"upstream's group set {phase} is inconsistent: rank {rank} runs samples {ids} but their CP "
                f"partners differ, so upstream's ranks would wait on each other"
            )
        size, start = len(members), members[0]
        if size not in legal_sizes or members != list(range(start, start + size)) or start % size:
            raise PlannerUnsupported(
                f"upstream cannot run its own schedule: set {phase} forms a CP group of ranks {members} but "
                f"megatron-core only creates aligned groups of {sorted(legal_sizes)} ranks"
            )
        placed.update(members)
        groups.append(PlanGroup(ranks=tuple(members), microbatches=tuple((sid,) for sid in ids), phase=phase))
    return groups
