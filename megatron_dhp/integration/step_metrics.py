"""dhp's numbers of one step as named scalars, for the dashboards a training run already writes.

A step's plan says what the step does (its groups, microbatches, tokens per rank, sequences, its predicted time
against the lower bound, the speed it gave each rank, how long it took to solve) and the closed loop what the
last measured step did. `StepMetrics` turns both into one flat dict of `dhp/...` scalars. Every rank holds the
same plan and the same loop state, so the values are the same everywhere and whichever rank holds a writer logs
them without a collective. It is O(groups + samples), with no per-token work, since it runs on the step path (only
where a writer is, every --tensorboard-log-interval): 3.4 ms for dhp's plan of 4,096 wlbllm samples on 1,024 ranks
(122 groups) on a shared 2-core CPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from megatron_dhp.plan.plan import Plan

if TYPE_CHECKING:
    from megatron_dhp.closed_loop.loop import ClosedLoop

PREFIX = "dhp/"


def sample_tokens(plan: Plan) -> np.ndarray:
    """Each sample's tokens, in the order of `plan.samples`."""
    return np.fromiter((s.tokens for s in plan.samples), dtype=np.float64, count=len(plan.samples))


def tokens_per_rank(plan: Plan, lengths: np.ndarray | None = None) -> np.ndarray:
    """Tokens each domain position holds over the whole step: each group's tokens spread over its ranks by their
    shares (even shards: equally), summed over the rank's groups (padding left out). `lengths`: `sample_tokens`.

    One pass over the groups' samples and ranks, then two bincounts (no numpy call per group)."""
    lengths = sample_tokens(plan) if lengths is None else lengths
    ids: list[int] = []
    group_of: list[int] = []  # of each id
    ranks: list[int] = []
    parts: list[float] = []  # each rank's part of its group's tokens
    member_of: list[int] = []  # the group of each rank entry
    for k, g in enumerate(plan.groups):
        sample_ids = g.sample_ids
        ids += sample_ids
        group_of += [k] * len(sample_ids)
        ranks += g.ranks
        parts += [w / sum(g.shares) for w in g.shares] if g.shares else [1.0 / g.size] * g.size
        member_of += [k] * g.size
    totals = np.bincount(np.asarray(group_of, dtype=np.int64), weights=lengths[plan.positions(ids)],
                         minlength=len(plan.groups))
    return np.bincount(np.asarray(ranks, dtype=np.int64), weights=totals[member_of] * np.asarray(parts),
                       minlength=plan.world_size)


@dataclass
class StepMetrics:
    """A plan (and the closed loop) as `dhp/` scalars, step after step.

    Some names come and go: a group size one step has and the next lacks, a rank that was slow. Once written, such
    a name is written every step (0 groups of that size; the rank's speed, 1 again when it recovers), so that a
    dashboard's line drops to it rather than holding the last value it saw.
    """

    _sizes: set[int] = field(default_factory=set)
    """Group sizes written so far (`dhp/groups-size-{d}`)."""
    _watched: set[int] = field(default_factory=set)
    """Domain positions that were slow in some plan (`dhp/rank-speed-{p}`)."""

    def of(self, plan: Plan, *, loop: ClosedLoop | None = None, plan_wait_s: float | None = None) -> dict[str, float]:
        """The step's scalars (see docs/megatron-lm.md, "What dhp logs"): the plan's, the closed loop's when it
        is adaptive, and how long this rank waited for the plan (`plan_wait_s`, given)."""
        out = self._plan(plan)
        if loop is not None and loop.adaptive:
            scales = loop.fit.scales
            out.update({"model-attention-factor": scales.attention, "model-rest-factor": scales.rest})
            if loop.last_step is not None:
                predicted, measured = loop.last_step
                out.update({"measured-step-time": measured, "measured-step-time-predicted": predicted})
        if plan_wait_s is not None:
            out["plan-wait-ms"] = plan_wait_s * 1e3
        return {PREFIX + name: float(value) for name, value in out.items()}

    def _plan(self, plan: Plan) -> dict[str, float]:
        lengths = sample_tokens(plan)
        tokens = tokens_per_rank(plan, lengths)
        out = {
            "sequences": len(plan.samples),
            "longest-sequence": lengths.max(initial=0.0),
            "microbatches": plan.num_microbatches,
            "groups": len(plan.groups),
            "phases": plan.num_phases,
            "tokens-per-rank-max": tokens.max(initial=0.0),
            "tokens-per-rank-mean": tokens.mean() if tokens.size else 0.0,
        }
        sizes = Counter(g.size for g in plan.groups)
        self._sizes |= sizes.keys()
        out.update({f"groups-size-{d}": sizes.get(d, 0) for d in sorted(self._sizes)})
        if plan.predicted_step_time_s is not None:
            out["step-time-predicted"] = plan.predicted_step_time_s
        if plan.lower_bound_s:
            out["lower-bound-time"] = plan.lower_bound_s
            if plan.predicted_step_time_s is not None:
                out["step-vs-lower-bound"] = plan.predicted_step_time_s / plan.lower_bound_s
        if plan.solve_time_ms is not None:
            out["solve-ms"] = plan.solve_time_ms
        slow = plan.slow_ranks()
        self._watched |= {p for p, _ in slow}
        speeds = plan.rank_speeds or (1.0,) * plan.world_size
        out.update({"slow-ranks": len(slow), "slowest-rank-speed": min(speeds, default=1.0)})
        out.update({f"rank-speed-{p}": speeds[p] for p in sorted(self._watched) if p < len(speeds)})
        return out
