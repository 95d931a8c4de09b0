"""Megatron's static context parallelism as a planner (`static`).

One CP size for the whole run, the smallest power of two whose groups hold the dataset's longest sample;
DP = N / CP replicas of contiguous ranks; each replica runs the same number of microbatches of at most
CP x M tokens; samples go longest-first to the least-loaded replica that has room.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from megatron_dhp.cost.config import Domain
from megatron_dhp.cost.model import CostModel
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.solver.base import Planner
from megatron_dhp.workload.sample import Batch


def static_cp_size(max_tokens: int, domain: Domain, min_ranks: int = 1) -> int:
    """Smallest power of two CP that divides N, holds `max_tokens` and has at least `min_ranks` ranks (the
    batch's memory minimum, encoder activations included); else the smallest such divisor."""
    n, cap = domain.world_size, domain.max_tokens_per_rank
    need = max(math.ceil(max_tokens / cap), min_ranks)
    if need > n:
        raise DhpError(
            f"a {max_tokens}-token sample needs {need} ranks of {cap} tokens but the domain has {n}; "
            "raise --world-size or --max-tokens-per-rank, or pass --truncate"
        )
    divisors = [d for d in range(need, n + 1) if n % d == 0]
    pow2 = [d for d in divisors if d & (d - 1) == 0]
    return (pow2 or divisors)[0]


@dataclass
class StaticPlanner(Planner):
    """Static CP x DP with greedy packing; `dataset_max_tokens` fixes CP (default: the batch's longest)."""

    dataset_max_tokens: int | None = None
    name: str = "static"

    def solve(self, batch: Batch, model: CostModel) -> list[PlanGroup]:
        """One group per DP replica, each with the same number of packed microbatches."""
        domain = model.domain
        longest = max(int(batch.lengths.max()), self.dataset_max_tokens or 0)
        footprint = model.footprint(batch.samples)
        cp = static_cp_size(longest, domain, int(footprint.min_degree().max()))
        dp = domain.world_size // cp
        replicas = [tuple(range(i * cp, (i + 1) * cp)) for i in range(dp)]
        bin_cap = cp * footprint.cap

        tokens = batch.lengths
        loads = footprint.load(np.arange(len(batch)), cp)
        times = model.sample_time(tokens, model.sample_work(batch.samples), cp, model.is_intra(replicas[0]))
        overhead = model.microbatch_overhead(cp)
        order = sorted(range(len(batch)), key=lambda i: (-times[i], -tokens[i], i))

        num_mb = max(1, math.ceil(int(loads.sum()) / (dp * bin_cap)))
        room = [[bin_cap] * num_mb for _ in range(dp)]
        bins: list[list[list[int]]] = [[[] for _ in range(num_mb)] for _ in range(dp)]
        load = [0.0] * dp
        by_load = [(0.0, r) for r in range(dp)]  # (load, replica), sorted
        for i in order:
            length, sid = int(loads[i]), batch.samples[i].id
            placed = self._place(by_load, room, length)
            if placed is None:  # no replica has room: every replica gets one more microbatch
                for r in range(dp):
                    room[r].append(bin_cap)
                    bins[r].append([])
                placed = (by_load[0][1], num_mb)
                num_mb += 1
            r, b = placed
            del by_load[bisect.bisect_left(by_load, (load[r], r))]
            load[r] += float(times[i]) + (overhead if not bins[r][b] else 0.0)
            bisect.insort(by_load, (load[r], r))
            room[r][b] -= length
            bins[r][b].append(sid)
        # A replica left without samples (a batch smaller than DP) still joins the step, with no work.
        return [PlanGroup(ranks=replicas[r], microbatches=tuple(tuple(mb) for mb in bins[r] if mb)) for r in range(dp)]

    @staticmethod
    def _place(by_load: list[tuple[float, int]], room: list[list[int]], length: int) -> tuple[int, int] | None:
        """Least-loaded replica with a microbatch that has room; best fit among its microbatches."""
        for _, r in by_load:
            fits = [(left - length, b) for b, left in enumerate(room[r]) if left >= length]
            if fits:
                return r, min(fits)[1]
        return None
