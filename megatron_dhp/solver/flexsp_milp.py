"""FlexSP as a planner (`flexsp-milp`): "FlexSP: Accelerating Large Language Model Training via Flexible
Sequence Parallelism" (ASPLOS 2025, arXiv 2412.01523) and its code, PKU-DAIR/Hetu-Galvatron branch `flexsp`.

1. Sequence Blaster: sort the batch longest first and cut it into mb contiguous microbatches minimising the
   largest token sum; mb0 = ceil(tokens / (N M)), raised until every microbatch fits N x M; try mb0 .. mb0+3
   and keep the count with the least summed makespan (FlexSP's step time: sum over microbatches of the
   slowest group). Microbatch k becomes phase k of the plan, all N ranks regrouped.
2. Bucketing, per microbatch: sort ascending and cut into B buckets minimising padding (a bucket's
   boundary is its longest sample); B starts at 16 and grows until padded tokens <= (real + N M) / 2. With
   B at the number of distinct lengths bucketing is exact: FlexSP's per-sequence MILP is this same model.
3. The MILP of `flexsp_model` over buckets x power-of-two slots, HiGHS (FlexSP uses SCIP) under
   `time_limit_s` per MILP, warm-started from the homogeneous greedy solution, each in a process stopped at
   a hard deadline (HiGHS does not always honour its limit).
4. Concrete samples fill the solved per-bucket counts in a seeded random order (FlexSP draws at random);
   groups take contiguous rank ranges in ascending size order, as FlexSP lays them out.

Times come from our cost model: a bucket's time on sp ranks is its slowest member's t(L, sp)
(= t(boundary, sp) for text), placed intra-node iff sp <= gpus_per_node, which FlexSP's aligned layout
makes true on a power-of-two N, and a group's overhead beta is what the model charges a microbatch on sp
ranks. Group sizes are 2 .. N (FlexSP never uses 1, though our model gives one
rank no communication). Groups of powers of two fill N exactly only for an even N, so an odd N, or a batch
whose long samples need a group larger than the largest power of two <= N, is `PlannerUnsupported`.
Under a binding time limit HiGHS may return different incumbents run to run, as SCIP does for FlexSP (which
broadcasts its plan for that reason); instances it solves to optimality plan deterministically.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from megatron_dhp.cost.config import Domain
from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.solver.base import Planner, PlannerUnsupported, contiguous_ranks
from megatron_dhp.solver.flexsp_model import BucketProblem, SlotSolution, solve_bucket_milp
from megatron_dhp.solver.partition import PartitionDP, max_sum_partition, padding_cost
from megatron_dhp.workload.sample import Batch

FIRST_BUCKETS = 16
EXTRA_MICROBATCH_COUNTS = 3


def bucket_cuts(sorted_tokens: np.ndarray, capacity: int) -> list[int]:
    """FlexSP's bucketing: the fewest buckets >= 16 whose padding fits half the unused capacity."""
    slack = (capacity - float(sorted_tokens.sum())) / 2
    dp = PartitionDP(padding_cost(sorted_tokens), np.add)
    first = min(FIRST_BUCKETS, len(sorted_tokens))
    parts = next(k for k, padding in dp.layers(len(sorted_tokens)) if k >= first and padding <= slack)
    return dp.cuts(parts)


@dataclass
class _Microbatch:
    """One solved microbatch: the batch positions of each group's samples and their group sizes."""

    makespan_s: float
    sizes: list[int]
    members: list[list[int]]


@dataclass(frozen=True)
class _Instance:
    """One batch prepared for FlexSP: lengths, per-size sample times, and the Blaster's longest-first order."""

    tokens: np.ndarray
    """Each sample's memory in tokens (its length, and encoder activations where they count:
    `Footprint.linear`), what FlexSP's memory terms take."""
    cap: int
    """Tokens per rank (M, less global's encoder share)."""
    times: np.ndarray
    """(samples, sizes) t(L, sp) of each sample on each candidate size."""
    sizes: np.ndarray
    model: CostModel
    seed: int

    @property
    def order(self) -> np.ndarray:
        return np.lexsort((np.arange(len(self.tokens)), -self.tokens))  # longest first, ties by position

    def blast(self, num_mb: int) -> list[np.ndarray]:
        """The Sequence Blaster: `num_mb` contiguous chunks of the sorted batch, least largest token sum."""
        order = self.order
        cuts = max_sum_partition(self.tokens[order].astype(np.float64), num_mb)
        return [order[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    def first_count(self) -> int:
        """mb0: ceil(tokens / (N M)), raised until every chunk fits the domain."""
        capacity = self.model.domain.world_size * self.cap
        count = max(1, math.ceil(int(self.tokens.sum()) / capacity))
        while any(int(self.tokens[c].sum()) > capacity for c in self.blast(count)):
            count += 1
        return count


@dataclass
class FlexSPPlanner(Planner):
    """FlexSP: Sequence Blaster microbatches, bucketing, and a MILP over power-of-two groups per microbatch."""

    time_limit_s: float = 10.0
    name: str = "flexsp-milp"

    def solve(self, batch: Batch, model: CostModel) -> list[PlanGroup]:
        """Blast into microbatches, solve each with the MILP, and keep the best microbatch count."""
        footprint = model.footprint(batch.samples)
        sizes = _group_sizes(batch, model.domain, footprint)
        tokens = batch.lengths
        times = model.time_table(tokens, model.sample_work(batch.samples), sizes)
        inst = _Instance(footprint.linear(int(sizes[-1])), footprint.cap, times, sizes, model,
                         0 if batch.seed is None else batch.seed)
        first = inst.first_count()
        best = self._best_count(inst, range(first, min(first + EXTRA_MICROBATCH_COUNTS, len(tokens)) + 1))
        count = first + EXTRA_MICROBATCH_COUNTS + 1
        while best is None and count <= len(tokens):  # none of the four fills the domain: keep splitting
            best = self._best_count(inst, range(count, count + 1))
            count += 1
        if best is None:
            raise PlannerUnsupported(
                f"flexsp-milp: no microbatch count lets power-of-two groups fill {model.domain.world_size} ranks"
            )
        groups = []
        for phase, mb in enumerate(best):
            by_size = sorted(range(len(mb.sizes)), key=lambda g: mb.sizes[g])  # FlexSP: ascending sizes
            for ranks, g in zip(contiguous_ranks(mb.sizes[g] for g in by_size), by_size):
                ids = tuple(batch.samples[i].id for i in mb.members[g])
                groups.append(PlanGroup(ranks=ranks, microbatches=(ids,), phase=phase))
        return groups

    def _best_count(self, inst: _Instance, counts: range) -> list[_Microbatch] | None:
        """Solve every microbatch of every count, one HiGHS process per core at a time (FlexSP uses a process
        pool), and keep the count with the least summed makespan."""
        tasks = [(c, k, chunk) for c in counts for k, chunk in enumerate(inst.blast(c))]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            solved = list(pool.map(lambda task: self._solve_microbatch(inst, task[1], task[2]), tasks))
        by_count = {c: [mb for (c2, _, _), mb in zip(tasks, solved) if c2 == c] for c in counts}
        feasible = [mbs for mbs in by_count.values() if all(mb is not None for mb in mbs)]
        return min(feasible, key=lambda mbs: sum(mb.makespan_s for mb in mbs), default=None)

    def _solve_microbatch(self, inst: _Instance, index: int, chunk: np.ndarray) -> _Microbatch | None:
        """Bucket one microbatch, solve its MILP, and draw concrete samples into the solved counts."""
        domain = inst.model.domain
        ascending = chunk[np.lexsort((chunk, inst.tokens[chunk]))]
        cuts = bucket_cuts(inst.tokens[ascending].astype(np.float64), domain.world_size * inst.cap)
        buckets = [ascending[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        problem = BucketProblem(
            counts=np.array([len(b) for b in buckets]),
            tokens=np.array([int(inst.tokens[b].max()) for b in buckets]),
            times=np.array([inst.times[b].max(axis=0) for b in buckets]),
            sizes=inst.sizes,
            world_size=domain.world_size,
            max_tokens_per_rank=inst.cap,
            overhead_s=np.array([inst.model.microbatch_overhead(int(sp)) for sp in inst.sizes]),
        )
        solution = solve_bucket_milp(problem, self.time_limit_s)
        if solution is None:
            return None
        rng = np.random.default_rng([inst.seed, index])
        return _Microbatch(solution.makespan_s, list(solution.sizes), draw_members(solution, buckets, rng))


def _group_sizes(batch: Batch, domain: Domain, footprint: Footprint) -> np.ndarray:
    """FlexSP's candidate sizes 2, 4, ..., <= N, or `PlannerUnsupported` where they cannot plan the batch."""
    n = domain.world_size
    if n % 2:
        raise PlannerUnsupported(f"flexsp-milp: groups of 2, 4, 8, ... ranks cannot fill an odd domain of {n}")
    sizes = 2 ** np.arange(1, int(math.log2(n)) + 1)
    memory = footprint.linear(int(sizes[-1]))  # its length where no encoder memory counts
    k = int(np.lexsort((-np.arange(len(memory)), memory))[-1])  # the largest, ties to the first
    if memory[k] > sizes[-1] * footprint.cap:
        s = batch.samples[k]
        raise PlannerUnsupported(
            f"flexsp-milp: sample {s.id} ({int(memory[k])} tokens) needs more than "
            f"{sizes[-1]} ranks of {footprint.cap} tokens, and FlexSP's groups are powers of two no larger than "
            f"the domain of {n}"
        )
    return sizes


def draw_members(solution: SlotSolution, buckets: list[np.ndarray], rng: np.random.Generator) -> list[list[int]]:
    """Hand each bucket's samples, in a seeded random order, to the groups by the solved counts."""
    members: list[list[int]] = [[] for _ in solution.sizes]
    for k, bucket in enumerate(buckets):
        shuffled = rng.permutation(bucket)
        bounds = np.cumsum([0, *solution.counts[:, k]])
        for g in range(len(solution.sizes)):
            members[g].extend(int(i) for i in shuffled[bounds[g]: bounds[g + 1]])
    return members
