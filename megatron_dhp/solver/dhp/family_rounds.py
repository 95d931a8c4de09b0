"""fcp-ref's rounds built on the group family: every round's groups on disjoint family windows.

fcp-ref sizes each round's atomic groups by a DP over any degree and lays them out contiguously in bin
order, so its rounds almost never consist of family groups, and moving them onto the family afterwards
(`rounds.fit_to_family`) fails on nearly every long-tailed batch; under pipeline parallelism dhp then
lost its best layouts (24-31 % slower than with any groups). Here the same atomic groups (fcp-ref's
best-fit decreasing at the instance's cap) go into rounds first-fit decreasing, each on the first free
family window of its smallest family size that holds it; then, round by round, the slowest group moves
to a wider family window made only of free ranks and its own while that shortens it. Ranks a round
leaves free sit it out (a one-rank group with no microbatch).
"""

from __future__ import annotations

import numpy as np

from megatron_dhp.plan.family import GroupFamily
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.rounds import round_order
from megatron_dhp.solver.fcp_ref import Bin, bfd_pack
from megatron_dhp.workload.sample import Batch


class Round:
    """One round under construction: its free ranks (a bit mask for `GroupFamily.first_free`), and each
    group's bin and window."""

    def __init__(self, num_ranks: int) -> None:
        self.free = (1 << num_ranks) - 1
        self.windows: list[tuple[int, int]] = []  # (start, size) per group
        self.bins: list[Bin] = []

    def mask(self, k: int) -> int:
        """Group k's ranks."""
        start, size = self.windows[k]
        return ((1 << size) - 1) << start

    def add(self, b: Bin, start: int, size: int) -> None:
        """One more group."""
        self.bins.append(b)
        self.windows.append((start, size))
        self.free &= ~self.mask(len(self.bins) - 1)

    def move(self, k: int, start: int, size: int) -> None:
        """Group k to ranks [start, start + size)."""
        self.free |= self.mask(k)
        self.windows[k] = (start, size)
        self.free &= ~self.mask(k)


def group_time(inst: Instance, members: list[int], start: int, size: int) -> float:
    """Seconds of one microbatch of these samples on the window."""
    return inst.overhead(size) + float(inst.times(size, inst.model.is_intra((start, start + size - 1)))[members].sum())


def widen(inst: Instance, family: GroupFamily, rnd: Round) -> None:
    """Move the round's slowest group to the family window of free ranks and its own that shortens it most,
    while one does (each step strictly shortens the slowest group, so this ends)."""
    times = [group_time(inst, b.members, *w) for b, w in zip(rnd.bins, rnd.windows)]
    while True:
        k = int(np.argmax(times))
        best: tuple[float, int, int] | None = None
        free = rnd.free | rnd.mask(k)
        for size in (s for s in family.sizes if s > rnd.windows[k][1]):
            start = family.first_free(size, free)
            if start is not None:
                t = group_time(inst, rnd.bins[k].members, start, size)
                if t < (best[0] if best else times[k]):
                    best = (t, start, size)
        if best is None:
            return
        times[k], start, size = best
        rnd.move(k, start, size)


def family_rounds(inst: Instance, family: GroupFamily) -> list[Round]:
    """fcp-ref's atomic groups in rounds of family windows, first-fit decreasing, then widened."""
    bins = bfd_pack(inst.footprint, inst.min_degree)  # non-increasing min_cp
    rounds: list[Round] = []
    for b in bins:
        size = family.ceil_size(int(b.min_cp))
        for rnd in rounds:
            if (start := family.first_free(size, rnd.free)) is not None:
                break
        else:
            rnd = Round(inst.num_ranks)
            rounds.append(rnd)
            start = family.first_free(size, rnd.free)
        rnd.add(b, start, size)
    for rnd in rounds:
        widen(inst, family, rnd)
    return rounds


def family_round_layouts(inst: Instance, batch: Batch, family: GroupFamily) -> list[list[PlanGroup]]:
    """The family rounds (one microbatch per group, at most the instance's cap per rank) in 1F1B order and
    in first-fit order, as `rounds.round_layouts` gives fcp-ref's own."""
    ids = inst.ids
    rounds = family_rounds(inst, family)
    groups = [PlanGroup(ranks=tuple(range(start, start + size)), microbatches=(tuple(int(ids[i]) for i in b.members),),
                        phase=phase)
              for phase, rnd in enumerate(rounds) for b, (start, size) in zip(rnd.bins, rnd.windows)]
    groups += [PlanGroup(ranks=(r,), microbatches=(), phase=phase)
               for phase, rnd in enumerate(rounds) for r in range(inst.num_ranks) if rnd.free >> r & 1]
    phase_of = {q: k for k, q in enumerate(round_order(inst, [g for g in groups if g.microbatches]))}
    return [[PlanGroup(ranks=g.ranks, microbatches=g.microbatches, phase=phase_of[g.phase]) for g in groups], groups]
