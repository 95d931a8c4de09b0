"""FlexSP's parallelism MILP for one microbatch of bucketed samples, solved with HiGHS.

Re-implemented from shared/reference/flexsp.md section 3(c) (no code copied). Slots: for each power-of-two
group size sp >= 2 there are floor(N / sp) slots, or floor((N - sp_max) / sp) below the largest size any
bucket requires. Variables: A[k, p] >= 0 integer (samples of bucket k in slot p), m[p] binary (slot used),
M >= 0 (makespan). Minimise M subject to
  1. sum_p A[k, p] = |bucket k|;
  2. A[k, p] = 0 when slot p is below bucket k's minimum size (those columns are not created);
  3. memory: sum_k boundary_k A[k, p] <= M_tokens * sp_p;
  4. time: sum_k t_k(sp_p) A[k, p] + beta m[p] <= M;
  5. m[p] <= sum_k A[k, p] <= n m[p] (a slot is used exactly when it holds samples);
  6. sum_p sp_p m[p] = N (every rank is used).
Slots of one size are interchangeable, so we add symmetry-breaking rows (used slots first, loads
non-increasing); they remove only permuted copies of solutions and leave the optimum unchanged. FlexSP
warm-starts SCIP with homogeneous greedy solutions (`addSol`); HiGHS takes one start, the best of them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BucketProblem:
    """One microbatch, bucketed: sample counts per bucket and what one sample costs on each group size."""

    counts: np.ndarray
    """(K,) samples in each bucket."""
    tokens: np.ndarray
    """(K,) each bucket's boundary: the padded length charged against memory."""
    times: np.ndarray
    """(K, S) seconds of one of the bucket's samples on a group of `sizes[s]` ranks."""
    sizes: np.ndarray
    """(S,) candidate group sizes, ascending powers of two >= 2."""
    world_size: int
    max_tokens_per_rank: int
    overhead_s: float
    """beta: paid once per used group."""

    def allowed(self) -> np.ndarray:
        """(K, S): whether a bucket's sample fits one group of that size (size >= its minimum SP)."""
        return self.sizes[None, :] * self.max_tokens_per_rank >= self.tokens[:, None]

    def slot_sizes(self) -> np.ndarray:
        """The size of every slot, ascending, pruned below the largest size some bucket requires."""
        n = self.world_size
        need = int(self.sizes[np.argmax(self.allowed(), axis=1)].max())  # the largest minimum SP
        counts = [(n - need if sp < need else n) // sp for sp in self.sizes.tolist()]
        return np.repeat(self.sizes, counts)


@dataclass(frozen=True)
class SlotSolution:
    """A solution: the size of each used group and how many samples of each bucket it runs."""

    sizes: tuple[int, ...]
    counts: np.ndarray
    """(groups, K) samples of each bucket per group."""
    makespan_s: float
    optimal: bool


def group_times(problem: BucketProblem, sizes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """beta + sum_k t_k(sp) A[k] for each group."""
    size_index = np.searchsorted(problem.sizes, sizes)
    return problem.overhead_s + (counts * problem.times[:, size_index].T).sum(axis=1)


def homogeneous_greedy(problem: BucketProblem) -> SlotSolution | None:
    """FlexSP's warm start: for each size dividing N, N/sp groups; samples longest first to the least-loaded
    group with memory room. The best feasible one, or None."""
    best: SlotSolution | None = None
    order = np.argsort(-problem.tokens, kind="stable")
    allowed = problem.allowed()
    for s, sp in enumerate(problem.sizes.tolist()):
        num_groups = problem.world_size // sp
        if problem.world_size % sp or not allowed[:, s].all() or problem.counts.sum() < num_groups:
            continue
        counts = np.zeros((num_groups, len(problem.counts)), dtype=np.int64)
        room = np.full(num_groups, sp * problem.max_tokens_per_rank, dtype=np.int64)
        heap = [(0.0, g) for g in range(num_groups)]
        feasible = True
        for k in order:
            for _ in range(int(problem.counts[k])):
                skipped = []
                while heap and room[heap[0][1]] < problem.tokens[k]:
                    skipped.append(heapq.heappop(heap))
                if not heap:
                    feasible = False
                    break
                load, g = heapq.heappop(heap)
                counts[g, k] += 1
                room[g] -= problem.tokens[k]
                heapq.heappush(heap, (load + problem.times[k, s], g))
                for item in skipped:
                    heapq.heappush(heap, item)
            if not feasible:
                break
        if not feasible or (counts.sum(axis=1) == 0).any():
            continue
        sizes = np.full(num_groups, sp)
        makespan = float(group_times(problem, sizes, counts).max())
        if best is None or makespan < best.makespan_s:
            best = SlotSolution(tuple(sizes.tolist()), counts, makespan, optimal=False)
    return best


class _Rows:
    """Row-wise sparse constraint matrix under construction."""

    def __init__(self) -> None:
        self.start, self.index, self.value, self.lower, self.upper = [0], [], [], [], []

    def add(self, cols: list[int] | np.ndarray, vals: list[float] | np.ndarray, lower: float, upper: float) -> None:
        self.index.extend(int(c) for c in cols)
        self.value.extend(float(v) for v in vals)
        self.start.append(len(self.index))
        self.lower.append(lower)
        self.upper.append(upper)


def solve_bucket_milp(problem: BucketProblem, time_limit_s: float) -> SlotSolution | None:
    """The MILP's best solution within the time limit (warm-started), or None if there is none."""
    import highspy

    slot_size = problem.slot_sizes()
    size_index = np.searchsorted(problem.sizes, slot_size)
    allowed = problem.allowed()[:, size_index]  # (K, P)
    num_buckets, num_slots = allowed.shape
    pairs = np.argwhere(allowed)  # one A column per allowed (bucket, slot)
    num_a = len(pairs)
    m_col = num_a + np.arange(num_slots)
    makespan_col = num_a + num_slots
    total = int(problem.counts.sum())
    inf = highspy.kHighsInf
    cap = problem.max_tokens_per_rank

    a_of_slot = [np.flatnonzero(pairs[:, 1] == p) for p in range(num_slots)]
    load_vals = [problem.times[pairs[cols, 0], size_index[p]] for p, cols in enumerate(a_of_slot)]
    rows = _Rows()
    for k in range(num_buckets):  # 1
        cols = np.flatnonzero(pairs[:, 0] == k)
        rows.add(cols, np.ones(len(cols)), problem.counts[k], problem.counts[k])
    for p, cols in enumerate(a_of_slot):
        rows.add(cols, problem.tokens[pairs[cols, 0]], -inf, cap * slot_size[p])  # 3
        rows.add([*cols, m_col[p], makespan_col], [*load_vals[p], problem.overhead_s, -1.0], -inf, 0.0)  # 4
        rows.add([*cols, m_col[p]], [*np.ones(len(cols)), -total], -inf, 0.0)  # 5, upper
        rows.add([*cols, m_col[p]], [*np.ones(len(cols)), -1.0], 0.0, inf)  # 5, lower
    rows.add(m_col, slot_size, problem.world_size, problem.world_size)  # 6
    area_cols = [c for p, cols in enumerate(a_of_slot) for c in [*cols, m_col[p]]]
    area_vals = [v for p in range(num_slots) for v in [*(slot_size[p] * load_vals[p]), slot_size[p] * problem.overhead_s]]
    rows.add([*area_cols, makespan_col], [*area_vals, -problem.world_size], -inf, 0.0)  # area: sum sp load <= N M
    for p in range(num_slots - 1):  # symmetry: among equal slots, used ones first and loads non-increasing
        if slot_size[p] == slot_size[p + 1]:
            q = p + 1
            rows.add([m_col[p], m_col[q]], [1.0, -1.0], 0.0, inf)
            cols = [*a_of_slot[p], *a_of_slot[q]]
            rows.add(cols, [*load_vals[p], *-load_vals[q]], 0.0, inf)

    lp = highspy.HighsLp()
    lp.num_col_ = num_a + num_slots + 1
    lp.num_row_ = len(rows.lower)
    lp.col_cost_ = np.r_[np.zeros(num_a + num_slots), 1.0]
    lp.col_lower_ = np.zeros(lp.num_col_)
    lp.col_upper_ = np.r_[problem.counts[pairs[:, 0]], np.ones(num_slots), inf].astype(np.float64)
    lp.row_lower_ = np.asarray(rows.lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(rows.upper, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = lp.num_col_
    lp.a_matrix_.num_row_ = lp.num_row_
    lp.a_matrix_.start_ = np.asarray(rows.start, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(rows.index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(rows.value, dtype=np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * (num_a + num_slots) + [highspy.HighsVarType.kContinuous]

    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("random_seed", 0)
    highs.passModel(lp)
    warm = homogeneous_greedy(problem)
    if warm is not None:
        highs.setSolution(lp.num_col_, np.arange(lp.num_col_, dtype=np.int32), _as_columns(problem, warm, pairs, slot_size))
    highs.run()
    status = highs.getModelStatus()
    if highs.getInfo().primal_solution_status != 2:  # no feasible point found
        return warm
    values = np.rint(np.asarray(highs.getSolution().col_value[:num_a]))
    counts = np.zeros((num_slots, num_buckets), dtype=np.int64)
    counts[pairs[:, 1], pairs[:, 0]] = values
    used = counts.sum(axis=1) > 0
    sizes = slot_size[used]
    makespan = float(group_times(problem, sizes, counts[used]).max())
    solution = SlotSolution(tuple(sizes.tolist()), counts[used], makespan, status == highspy.HighsModelStatus.kOptimal)
    return warm if warm is not None and warm.makespan_s < solution.makespan_s else solution


def _as_columns(problem: BucketProblem, solution: SlotSolution, pairs: np.ndarray, slot_size: np.ndarray) -> np.ndarray:
    """A homogeneous solution as MILP column values: its groups, heaviest first, in the slots of its size."""
    num_a = len(pairs)
    x = np.zeros(num_a + len(slot_size) + 1)
    first = int(np.searchsorted(slot_size, solution.sizes[0]))
    loads = group_times(problem, np.asarray(solution.sizes), solution.counts)
    a_index = {(int(k), int(p)): i for i, (k, p) in enumerate(pairs)}
    for g, row in enumerate(solution.counts[np.argsort(-loads, kind="stable")]):
        p = first + g
        x[num_a + p] = 1.0
        for k in np.flatnonzero(row):
            x[a_index[(int(k), p)]] = row[k]
    x[-1] = solution.makespan_s
    return x
