"""Score a plan with a cost model: when each group starts and ends, and the step time.

Phases run in order. A group starts at the latest finish time of its ranks so far and its ranks finish at
start + group time, where a group's time is the sum of its microbatches (docs/cost-model.md). A plan
with `phase_barrier` also makes every rank wait for all ranks at each phase change. Every rank starts at the
cost model's step overhead sigma (0 unless profiled). A plan with P > 1 pipeline stages is priced per stage
in 1F1B order instead (`cost.pipeline`).

The encoder is priced with the placement the plan was made for (`Plan.encoder_placement`). Its time stays
apart: each microbatch's encoder seconds inside the groups (`split`, `replicate`), and the step-level phase
of `global` before the first and after the last microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from megatron_dhp.cost.encoder import EncoderPhase
from megatron_dhp.cost.model import CostModel
from megatron_dhp.cost.pipeline import pipeline_ops
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.plan.plan import Plan


@dataclass(frozen=True)
class GroupSpan:
    """When one group of the plan runs, and how long each of its microbatches takes."""

    group_index: int
    """Index of the group in `plan.groups`."""
    start_s: float
    """When the last of its ranks is free (phase order, and every barrier before it); under pipeline
    parallelism, when its first op starts on any stage."""
    end_s: float
    """`start_s` plus the sum of its microbatches; under pipeline parallelism, when its last op ends."""
    microbatch_s: tuple[float, ...]
    """Each microbatch's seconds: the overhead of the group's size plus its samples' times."""
    encoder_s: tuple[float, ...] = ()
    """The encoder's seconds inside each microbatch (part of `microbatch_s`; 0 under `global`)."""


@dataclass(frozen=True)
class Timeline:
    """The simulated step: every group's span and every rank's finish and busy time."""

    step_time_s: float
    spans: tuple[GroupSpan, ...]
    rank_finish_s: np.ndarray
    """When each domain position ends its step (its last stage, under pipeline parallelism)."""
    rank_busy_s: np.ndarray
    """Seconds each position computes (per stage, under pipeline parallelism: every stage is busy alike)."""
    encoder_before_s: float = 0.0
    """`global`'s encoder forward and embedding all-to-all, on every rank before its first group."""
    encoder_after_s: float = 0.0
    """`global`'s gradient all-to-all and encoder backward, on every rank after the last group ends."""

    @property
    def encoder_in_groups_s(self) -> float:
        """The encoder seconds inside the groups' microbatches, summed over groups."""
        return float(sum(sum(s.encoder_s) for s in self.spans))

    @property
    def idle_fraction(self) -> float:
        """Share of rank-seconds spent waiting within the step."""
        total = self.step_time_s * len(self.rank_busy_s)
        return 1.0 - float(self.rank_busy_s.sum()) / total if total > 0 else 0.0


class PlanTimes:
    """Every microbatch's seconds of a plan, and the encoder's seconds inside each, priced in one pass over all
    its samples (each in its group's size, placement and speed): per group, the model's calls cost more than
    the replay itself."""

    def __init__(self, plan: Plan, model: CostModel) -> None:
        groups = plan.groups
        ids = [i for g in groups for mb in g.microbatches for i in mb]
        order = np.array(plan.positions(ids), dtype=np.int64)
        per_group = [sum(len(mb) for mb in g.microbatches) for g in groups]
        paces = [model.group_pace(g.ranks, g.shares) for g in groups]
        size = np.repeat([g.size for g in groups], per_group)
        intra = np.repeat([model.is_intra(g.ranks) for g in groups], per_group)
        at, slowest, comm_scale = (np.repeat([getattr(p, k) for p in paces], per_group)
                                   for k in ("speed", "slowest", "comm_scale"))
        samples = [plan.samples[k] for k in order]
        tokens = np.fromiter((s.tokens for s in samples), dtype=np.float64, count=len(samples))
        uneven = bool(len(at)) and (comm_scale != 1.0).any()
        t = model.sample_time(tokens, model.sample_work(samples), size, intra,
                              at if len(at) and (at != 1.0).any() else 1.0,
                              **({"slowest": slowest, "comm_scale": comm_scale} if uneven else {}))
        enc = np.asarray(model.encoder_time(samples, size), dtype=np.float64) / at if len(samples) else np.zeros(0)
        bounds = np.cumsum([0] + [len(mb) for g in groups for mb in g.microbatches]).tolist()
        self._groups: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
        encodes = bool(enc.any())  # (text alone: no encoder seconds to sum)
        k = 0
        for g, p in zip(groups, paces):
            m = model.microbatch_overhead(g.size, p.slowest)
            spans = list(zip(bounds[k : k + len(g.microbatches)], bounds[k + 1 : k + 1 + len(g.microbatches)]))
            # (each microbatch summed on its own, as numpy sums a slice: the same seconds to the last bit)
            self._groups.append((tuple(m + float(t[a:b].sum()) for a, b in spans),
                                 tuple(float(enc[a:b].sum()) for a, b in spans) if encodes else (0.0,) * len(spans)))
            k += len(g.microbatches)

    def group(self, group_index: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Each microbatch's seconds, and the encoder's seconds inside each, of one group."""
        return self._groups[group_index]

    def microbatch_times(self) -> dict[int, tuple[float, ...]]:
        """Each group's microbatch seconds, by group index: its overhead (m, + lambda if d > 1) + sum of its
        samples' t(L, d), at the group's pace (`CostModel.group_pace`)."""
        return {gi: mbs for gi, (mbs, _) in enumerate(self._groups)}


def simulate(plan: Plan, model: CostModel) -> Timeline:
    """Replay the plan's groups phase by phase under the cost model (per stage in 1F1B when P > 1), with the
    encoder placed as the plan says."""
    if plan.encoder_placement not in CONCRETE_PLACEMENTS:
        raise DhpError(f"plan encoder_placement {plan.encoder_placement!r} must be one of {', '.join(CONCRETE_PLACEMENTS)}")
    model = model.with_placement(plan.encoder_placement)
    phase_s = model.encoder_phase(plan.samples)
    if plan.pipeline_stages > 1:
        return around_encoder_phase(simulate_pipeline(plan, model), phase_s)
    finish = np.full(plan.world_size, model.step_overhead_s + phase_s.before_s)
    busy = np.zeros(plan.world_size)
    spans: list[GroupSpan] = []
    order = sorted(range(len(plan.groups)), key=lambda i: plan.groups[i].phase)
    times = PlanTimes(plan, model)
    phase = 0
    for gi in order:
        if plan.phase_barrier and plan.groups[gi].phase != phase:
            phase = plan.groups[gi].phase
            finish[:] = finish.max()
        ranks = list(plan.groups[gi].ranks)
        mbs, enc = times.group(gi)
        start = float(finish[ranks].max())
        end = start + sum(mbs)
        finish[ranks] = end
        busy[ranks] += end - start
        spans.append(GroupSpan(gi, start, end, mbs, enc))
    spans.sort(key=lambda s: s.group_index)
    if phase_s.total_s:  # every rank encodes before its groups and after the last one ends
        busy += phase_s.total_s
        finish[:] = finish.max() + phase_s.after_s
    return Timeline(float(finish.max()), tuple(spans), finish, busy, phase_s.before_s, phase_s.after_s)


def around_encoder_phase(timeline: Timeline, phase_s: EncoderPhase) -> Timeline:
    """The 1F1B timeline with `global`'s encoder phase before its first and after its last slot. The encoder
    sits on the first pipeline stage, whose ranks are the domain's N, so the phase is the one of P = 1."""
    if not phase_s.total_s:
        return timeline
    spans = tuple(replace(s, start_s=s.start_s + phase_s.before_s, end_s=s.end_s + phase_s.before_s)
                  for s in timeline.spans)
    finish = np.full_like(timeline.rank_finish_s, timeline.rank_finish_s.max() + phase_s.total_s)
    return Timeline(float(finish.max()), spans, finish, timeline.rank_busy_s + phase_s.total_s,
                    phase_s.before_s, phase_s.after_s)


def simulate_pipeline(plan: Plan, model: CostModel) -> Timeline:
    """The plan's slots on every stage in 1F1B order (`cost.pipeline.pipeline_ops`)."""
    times = PlanTimes(plan, model).microbatch_times()
    start, end, unit_s, rows, unit_of = pipeline_ops(plan, model, times)
    p, sigma = plan.pipeline_stages, model.step_overhead_s
    per_unit = 2 * p * plan.virtual_stages  # ops of one unit are contiguous: (stage, chunk, F/B)
    unit_start = start.reshape(-1, per_unit).min(axis=1) if len(unit_s) else start
    unit_end = end.reshape(-1, per_unit).max(axis=1) if len(unit_s) else end
    spans = []
    for gi in range(len(plan.groups)):
        units = [unit_of[(gi, j)] for j in range(len(times[gi]))] if times[gi] else []
        first = float(unit_start[units].min()) if units else sigma
        last = float(unit_end[units].max()) if units else sigma
        spans.append(GroupSpan(gi, first, last, times[gi]))
    finish = np.array([max((float(unit_end[u]) for u in row), default=sigma) for row in rows])
    busy = np.array([float(unit_s[row].sum()) / p if row else 0.0 for row in rows])
    return Timeline(float(finish.max()), tuple(spans), finish, busy)
