"""The DHP/FCP paper's two-stage solver as published (`fcp-ref`).

Re-implemented from the description of "DHP: Efficient Scaling of MLLM Training with Dynamic Hybrid
Parallelism" (arXiv 2602.21788, v2 "Efficient Scaling of LLM Training with Flexible Context Parallelism") and
the `Scheduler.compute_parallel_method` of GitHub O617/MMLC, `scheduler.py` (no code copied):
1. min_cp(L) = ceil(L / M) per sample (ring CP: any degree, no power-of-two rounding); with encoder memory,
   the memory rule's minimum (`plan.memory`).
2. Memory-aware best-fit decreasing: longest sample first into the existing bin with bin.min_cp >= its
   min_cp and room (bin.min_cp * M - used >= L) that leaves the least room; else a new bin of its min_cp.
   Each bin is an atomic group whose samples run as one packed microbatch.
3. A time table T_b(d) = overhead(d) + sum_i t(L_i, d) for d in [bin.min_cp, max_cp], from our cost model,
   the microbatch overhead priced as the simulator charges it (m, plus lambda on more than one rank).
   The DP cannot know where a group will sit, so it assumes the group is intra-node iff d <= gpus_per_node;
   the plan is then scored on its real contiguous layout by the simulator.
4. 2-D DP over bins: best[i][j] = min_d max(best[i-1][j-d], T_i(d)), the least makespan of the first i bins
   on exactly j ranks; the answer is best[K][N] (vectorised over j and d: O(K N D)).
5. Rank conservation: if no split fills N exactly (only when `max_cp_degree` caps every bin), take the best
   j < N and grow groups round-robin by one rank until they sum to N.
6. Groups take contiguous rank ranges in bin order.

Where the published code fails (more bins than ranks, or sum of min_cp > N: its DP has no solution; a
global batch of 512 long-tailed samples nearly always does), the bins run in several rounds, like the
paper's system running a large batch as several independently scheduled gradient-accumulation
microbatches: first-fit decreasing puts the bins into the fewest rounds whose min_cp sum fits N, steps 3-6
run per round, and round k becomes phase k of the plan (no barrier: a group starts when its ranks are free).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.solver.base import Planner, PlannerUnsupported, contiguous_ranks
from megatron_dhp.workload.sample import Batch


@dataclass
class Bin:
    """An atomic group from the BFD stage: its minimum degree and the batch positions it holds."""

    min_cp: int
    used: int
    members: list[int]


def bfd_pack(footprint: Footprint, min_cp: np.ndarray) -> list[Bin]:
    """Memory-aware best-fit decreasing packing of samples into atomic groups (step 2), a sample's size its
    memory (`plan.memory`: its tokens, and its images' encoder activations where they count).

    Open bins are kept sorted by (room, index), so the best fit (least room left, then the oldest bin) is
    the first bin from the sample's size on whose degree is enough: the search is a bisection, not a scan.
    A sample whose images every rank holds (`replicate`) takes more of a wider bin, so the scan goes on
    past bins too full for it at their degree.
    """
    bins: list[Bin] = []
    by_room: list[tuple[int, int]] = []
    cap = footprint.cap
    for i in np.lexsort((np.arange(len(min_cp)), -footprint.shared)).tolist():  # largest first, ties by position
        need = int(min_cp[i])
        k = bisect.bisect_left(by_room, (int(footprint.load(i, need)), -1))
        while k < len(by_room) and (bins[by_room[k][1]].min_cp < need
                                    or by_room[k][0] < footprint.load(i, bins[by_room[k][1]].min_cp)):
            k += 1
        if k < len(by_room):
            room, b = by_room.pop(k)
            length = int(footprint.load(i, bins[b].min_cp))
            bins[b].members.append(i)
            bins[b].used += length
            bisect.insort(by_room, (room - length, b))
        else:
            length = int(footprint.load(i, need))
            bisect.insort(by_room, (need * cap - length, len(bins)))
            bins.append(Bin(need, length, [i]))
    return bins


def split_rounds(bins: list[Bin], world_size: int) -> list[list[Bin]]:
    """First-fit decreasing of bins (BFD order has non-increasing min_cp) into rounds of <= N min ranks."""
    rounds: list[list[Bin]] = []
    free: list[int] = []
    for bin_ in bins:
        k = next((k for k, left in enumerate(free) if left >= bin_.min_cp), len(rounds))
        if k == len(rounds):
            rounds.append([])
            free.append(world_size)
        rounds[k].append(bin_)
        free[k] -= bin_.min_cp
    return rounds


def degree_table(model: CostModel, per_sample: np.ndarray, bins: list[Bin]) -> np.ndarray:
    """Step 3: `table[b, d - 1]` = T_b(d), inf below the bin's min_cp; `per_sample[i, d - 1]` is t(L_i, d)
    of batch position i."""
    overhead = np.array([model.microbatch_overhead(d) for d in range(1, per_sample.shape[1] + 1)])
    table = np.tile(overhead, (len(bins), 1))
    for b, bin_ in enumerate(bins):
        table[b] += per_sample[bin_.members].sum(axis=0)
        table[b, : bin_.min_cp - 1] = np.inf
    return table


def allocate_degrees(times: np.ndarray, world_size: int) -> list[int]:
    """Steps 4-5: one degree per bin minimising the largest T_b(d), together using all `world_size` ranks.

    `times[b, d - 1]` is T_b(d), inf where d is not allowed for bin b.

    Every bin takes at least its least allowed degree, so after bin b a split uses between lo_b (the sum of
    those degrees so far) and lo_b + slack ranks (slack: what the least degrees leave of the domain), and a
    bin adds at most slack ranks to its least degree. The DP runs over just those states and degrees: the
    same table and choices as over all (j, d), in O(K slack^2) instead of O(K N D).
    """
    num_bins, max_d = times.shape
    least = np.argmax(np.isfinite(times), axis=1) + 1
    slack = world_size - int(least.sum())
    assert slack >= 0 and np.isfinite(times[np.arange(num_bins), least - 1]).all(), \
        "the caller keeps the bins' minimum degrees within the domain"
    states = np.arange(slack + 1)  # state x: lo_b + x ranks used
    best = np.where(states == 0, 0.0, np.inf)
    choice = np.zeros((num_bins, slack + 1), dtype=np.int64)  # extra ranks over the least degree
    before = np.maximum(states[:, None] - states[None, :] + 1, 0)  # [x, e]: state x - e in [inf, *best]
    for b in range(num_bins):
        extras = min(slack, max_d - int(least[b])) + 1
        prev = np.concatenate([[np.inf], best])[before[:, :extras]]
        cand = np.maximum(prev, times[b, least[b] - 1 : least[b] - 1 + extras][None, :])
        choice[b] = np.argmin(cand, axis=1)
        best = cand[states, choice[b]]
    if np.isfinite(best[slack]):
        used = slack
    else:  # every bin at max_cp still leaves ranks over: the best split of fewer ranks, grown below
        fewer = np.flatnonzero(np.isfinite(best))[::-1]  # the most ranks among equally good splits
        used = int(fewer[np.argmin(best[fewer])])
    degrees = [0] * num_bins
    for b in range(num_bins - 1, -1, -1):
        extra = int(choice[b][used])
        degrees[b] = int(least[b]) + extra
        used -= extra
    for k in range(world_size - sum(degrees)):  # rank conservation, round-robin +1 (ring CP takes any size)
        degrees[k % num_bins] += 1
    return degrees


@dataclass
class FCPRefPlanner(Planner):
    """DHP/FCP: BFD packing into atomic groups, then a DP over group degrees minimising the makespan.

    `max_cp_degree` caps a group's degree as the published scheduler's option of that name does (its
    default, 32, was a deployment limit; None here means the whole domain, which ring CP allows).
    """

    max_cp_degree: int | None = None
    name: str = "fcp-ref"

    def solve(self, batch: Batch, model: CostModel) -> list[PlanGroup]:
        """Pack, split into rounds that fit, then size each round's groups by the makespan DP."""
        domain = model.domain
        n = domain.world_size
        max_cp = min(self.max_cp_degree or n, n)
        footprint = model.footprint(batch.samples)
        min_cp = footprint.min_degree()
        if int(min_cp.max()) > max_cp:
            s = batch.samples[int(np.argmax(min_cp))]
            raise PlannerUnsupported(
                f"fcp-ref: sample {s.id} ({s.tokens} tokens) needs {int(min_cp.max())} ranks of {footprint.cap} "
                f"tokens, above max_cp_degree {max_cp}"
            )
        return round_groups(model, batch, split_rounds(bfd_pack(footprint, min_cp), n), max_cp)


def round_groups(model: CostModel, batch: Batch, rounds: list[list[Bin]], max_cp: int) -> list[PlanGroup]:
    """Steps 3-6 per round: round k's bins as contiguous groups of phase k, sized by the makespan DP."""
    tokens, work = batch.lengths, model.sample_work(batch.samples)
    groups: list[PlanGroup] = []
    for phase, round_bins in enumerate(rounds):
        for ranks, bin_ in zip(contiguous_ranks(round_degrees(model, tokens, work, round_bins, max_cp)), round_bins):
            ids = tuple(batch.samples[i].id for i in bin_.members)
            groups.append(PlanGroup(ranks=ranks, microbatches=(ids,), phase=phase))
    return groups


def round_degrees(model: CostModel, tokens: np.ndarray, work: np.ndarray, round_bins: list[Bin], max_cp: int) -> list[int]:
    """`allocate_degrees` of one round, its table over the round's samples and the degrees a bin can reach
    (its minimum plus the round's slack); a round its minimum degrees fill has just that one split."""
    n = model.domain.world_size
    slack = n - sum(bin_.min_cp for bin_ in round_bins)
    if slack == 0:
        return [bin_.min_cp for bin_ in round_bins]
    members = [i for bin_ in round_bins for i in bin_.members]
    degrees = np.arange(1, min(max_cp, max(bin_.min_cp for bin_ in round_bins) + slack) + 1)
    per_sample = model.time_table(tokens[members], work[members], degrees)
    local, start = [], 0
    for bin_ in round_bins:  # the same bins, their members as rows of the round's table
        local.append(Bin(bin_.min_cp, bin_.used, list(range(start, start + len(bin_.members)))))
        start += len(bin_.members)
    return allocate_degrees(degree_table(model, per_sample, local), n)
