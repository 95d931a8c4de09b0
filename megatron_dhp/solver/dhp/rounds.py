"""Rounds for 1F1B: every phase a partition of the whole domain, each group running one microbatch.

Under pipeline parallelism every phase but the last is padded to its longest group's microbatch count
(`plan.pipeline_slots`), so a layout whose phases each cover every rank with one microbatch per group runs
no idle slot at all and gives every position the same slot count. The rounds are fcp-ref's (best-fit
decreasing into atomic groups of at most M // P tokens per rank, first-fit into rounds, a makespan DP over
each round's degrees: `solver/fcp_ref.py`); what 1F1B adds is their order. The fill waits on the first
slot's forward and the drain on the last slot's backward, twice as long, so the shortest round goes last,
the second shortest first, the rest longest first (as `pipeline_order` does within a group).
"""

from __future__ import annotations

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.solver.fcp_ref import FCPRefPlanner
from megatron_dhp.workload.sample import Batch


def round_groups(batch: Batch, model: CostModel) -> list[PlanGroup]:
    """fcp-ref's rounds under `model` (its per-rank cap is already M // P), ordered for 1F1B."""
    groups = FCPRefPlanner().solve(batch, model)
    by_id = {s.id: s for s in batch.samples}
    span: dict[int, float] = {}
    for g in groups:
        t = model.microbatch_time([by_id[i] for i in g.microbatches[0]], g.ranks)
        span[g.phase] = max(span.get(g.phase, 0.0), t)
    order = pipeline_order_of(sorted(span, key=lambda q: (-span[q], q)))
    phase_of = {q: k for k, q in enumerate(order)}
    return [PlanGroup(ranks=g.ranks, microbatches=g.microbatches, phase=phase_of[g.phase]) for g in groups]


def pipeline_order_of(longest_first: list) -> list:
    """Items sorted longest first, reordered for 1F1B: second shortest, the rest longest first, shortest."""
    if len(longest_first) < 3:
        return longest_first[::-1]
    return [longest_first[-2], *longest_first[:-2], longest_first[-1]]
