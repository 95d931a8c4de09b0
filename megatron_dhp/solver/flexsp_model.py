"""FlexSP's parallelism MILP for one microbatch of bucketed samples, solved with HiGHS.

Re-implemented from FlexSP's `solve_flexSP_bucket_seqs` (PKU-DAIR/Hetu-Galvatron, branch `flexsp`,
`galvatron/flexsp_solver/`; no code copied). Slots: for each power-of-two
group size sp >= 2 there are floor(N / sp) slots, or floor((N - sp_max) / sp) below the largest size any
bucket requires. Variables: A[k, p] >= 0 integer (samples of bucket k in slot p), m[p] binary (slot used),
M >= 0 (makespan). Minimise M subject to
  1. sum_p A[k, p] = |bucket k|;
  2. A[k, p] = 0 when slot p is below bucket k's minimum size (those columns are not created);
  3. memory: sum_k boundary_k A[k, p] <= M_tokens * sp_p;
  4. time: sum_k t_k(sp_p) A[k, p] + beta(sp_p) m[p] <= M;
  5. m[p] <= sum_k A[k, p] <= n m[p] (a slot is used exactly when it holds samples);
  6. sum_p sp_p m[p] = N (every rank is used).
Two kinds of rows are ours, added so HiGHS (FlexSP uses SCIP) spends its time limit well; neither changes
the optimum: the area cut sum_p sp_p time_p <= N M (each used slot runs within M), which lifts the LP bound
from ~30% of the optimum to within a fraction of a percent, and symmetry breaking among the interchangeable
slots of one size (used slots first, loads non-increasing). FlexSP warm-starts SCIP with homogeneous greedy
solutions (`addSol`); HiGHS takes one start, the best of them.

Each MILP runs in a child process (FlexSP, too, solves in a process pool) killed at a hard deadline: HiGHS
does not check its time limit everywhere (presolve's strengthenInequalities inside a RENS sub-MIP can loop
far past a 10 s limit; ERGO-Code/HiGHS#2226), and a planner must not hang. A MILP cut off
there keeps the homogeneous warm start, as one with no incumbent does.
"""

from __future__ import annotations

import functools
import heapq
import logging
import multiprocessing
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
    overhead_s: np.ndarray
    """(S,) beta: what one microbatch costs on a group of `sizes[s]` ranks, paid once per used group."""

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
    """beta(sp) + sum_k t_k(sp) A[k] for each group."""
    size_index = np.searchsorted(problem.sizes, sizes)
    return problem.overhead_s[size_index] + (counts * problem.times[:, size_index].T).sum(axis=1)


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


@dataclass(frozen=True)
class _Columns:
    """Where each variable sits: A[k, p] for allowed (bucket, slot) pairs, then m[p], then the makespan M."""

    slot_size: np.ndarray
    pairs: np.ndarray
    """(columns, 2): the (bucket, slot) of each A column."""
    load: list[np.ndarray]
    """Per slot: t_k(sp_p) of each of its A columns, in `of_slot` order."""
    of_slot: list[np.ndarray]
    """Per slot: its A columns."""

    @classmethod
    def of(cls, problem: BucketProblem) -> _Columns:
        slot_size = problem.slot_sizes()
        size_index = np.searchsorted(problem.sizes, slot_size)
        pairs = np.argwhere(problem.allowed()[:, size_index])  # constraint 2: no column where not allowed
        of_slot = [np.flatnonzero(pairs[:, 1] == p) for p in range(len(slot_size))]
        load = [problem.times[pairs[cols, 0], size_index[p]] for p, cols in enumerate(of_slot)]
        return cls(slot_size, pairs, load, of_slot)

    @property
    def num_a(self) -> int:
        return len(self.pairs)

    @property
    def m(self) -> np.ndarray:
        return self.num_a + np.arange(len(self.slot_size))

    @property
    def makespan(self) -> int:
        return self.num_a + len(self.slot_size)


def _constraints(problem: BucketProblem, col: _Columns, inf: float) -> _Rows:
    """Constraints 1 and 3-6, the area cut and the symmetry-breaking rows."""
    rows, total, m = _Rows(), int(problem.counts.sum()), col.m
    beta = problem.overhead_s[np.searchsorted(problem.sizes, col.slot_size)]
    for k, count in enumerate(problem.counts):  # 1
        cols = np.flatnonzero(col.pairs[:, 0] == k)
        rows.add(cols, np.ones(len(cols)), count, count)
    for p, cols in enumerate(col.of_slot):
        rows.add(cols, problem.tokens[col.pairs[cols, 0]], -inf, problem.max_tokens_per_rank * col.slot_size[p])  # 3
        rows.add([*cols, m[p], col.makespan], [*col.load[p], beta[p], -1.0], -inf, 0.0)  # 4
        rows.add([*cols, m[p]], [*np.ones(len(cols)), -total], -inf, 0.0)  # 5, upper
        rows.add([*cols, m[p]], [*np.ones(len(cols)), -1.0], 0.0, inf)  # 5, lower
    rows.add(m, col.slot_size, problem.world_size, problem.world_size)  # 6
    # Area cut: sum_p sp_p (load_p + beta_p m_p) <= N M, valid since each used slot's time is <= M. Without it
    # the LP bound spreads work over every slot and sits ~70% below the optimum on 500-sample microbatches.
    area_cols = [c for p, cols in enumerate(col.of_slot) for c in [*cols, m[p]]]
    area_vals = [v for p, sp in enumerate(col.slot_size) for v in [*(sp * col.load[p]), sp * beta[p]]]
    rows.add([*area_cols, col.makespan], [*area_vals, -problem.world_size], -inf, 0.0)
    for p in np.flatnonzero(col.slot_size[:-1] == col.slot_size[1:]):  # equal slots: used first, loads falling
        rows.add([m[p], m[p + 1]], [1.0, -1.0], 0.0, inf)
        rows.add([*col.of_slot[p], *col.of_slot[p + 1]], [*col.load[p], *-col.load[p + 1]], 0.0, inf)
    return rows


def _highs_model(problem: BucketProblem, col: _Columns, rows: _Rows, highspy) -> object:
    """The MILP as a HiGHS model: A and m integer, M continuous; minimise M."""
    lp = highspy.HighsLp()
    num_int = col.makespan
    lp.num_col_ = num_int + 1
    lp.num_row_ = len(rows.lower)
    lp.col_cost_ = np.r_[np.zeros(num_int), 1.0]
    lp.col_lower_ = np.zeros(lp.num_col_)
    lp.col_upper_ = np.r_[problem.counts[col.pairs[:, 0]], np.ones(len(col.slot_size)), highspy.kHighsInf].astype(float)
    lp.row_lower_ = np.asarray(rows.lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(rows.upper, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = lp.num_col_
    lp.a_matrix_.num_row_ = lp.num_row_
    lp.a_matrix_.start_ = np.asarray(rows.start, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(rows.index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(rows.value, dtype=np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_int + [highspy.HighsVarType.kContinuous]
    return lp


def hard_deadline_s(time_limit_s: float) -> float:
    """How long a MILP may run before its process is killed: twice HiGHS's own limit, plus start-up."""
    return 2 * time_limit_s + 5.0


@functools.cache
def _solver_processes() -> multiprocessing.context.BaseContext:
    """Fresh solver processes forked from a server that has imported this module (safe in a threaded or
    CUDA-initialised parent, and a fork costs milliseconds)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def solve_bucket_milp(problem: BucketProblem, time_limit_s: float) -> SlotSolution | None:
    """`solve_in_process` in a child process under `hard_deadline_s`; past it, the warm start."""
    ctx = _solver_processes()
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_solve_child, args=(send, problem, time_limit_s), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(hard_deadline_s(time_limit_s)):
            logging.getLogger(__name__).warning(
                "HiGHS ran past %.0f s on a %.0f s time limit; its process was stopped and the homogeneous warm "
                "start kept", hard_deadline_s(time_limit_s), time_limit_s)
            return homogeneous_greedy(problem)
        ok, value = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"the HiGHS solver process died (exit code {child.exitcode})") from None
    finally:
        child.kill()
        child.join()
        receive.close()
    if not ok:
        raise RuntimeError(f"the HiGHS solver process failed: {value}")
    return value


def _solve_child(send, problem: BucketProblem, time_limit_s: float) -> None:
    """Child process: solve and send `(True, solution)`, or `(False, error text)`."""
    try:
        send.send((True, solve_in_process(problem, time_limit_s)))
    except Exception as e:  # reported by the parent
        send.send((False, f"{type(e).__name__}: {e}"))
    finally:
        send.close()


def solve_in_process(problem: BucketProblem, time_limit_s: float) -> SlotSolution | None:
    """The MILP's best solution within the time limit (warm-started), or None if there is none."""
    import highspy

    col = _Columns.of(problem)
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("random_seed", 0)
    highs.passModel(_highs_model(problem, col, _constraints(problem, col, highspy.kHighsInf), highspy))
    warm = homogeneous_greedy(problem)
    if warm is not None:
        x = _as_columns(problem, warm, col)
        highs.setSolution(len(x), np.arange(len(x), dtype=np.int32), x)
    highs.run()
    if highs.getInfo().primal_solution_status != 2:  # no feasible point found
        return warm
    counts = np.zeros((len(col.slot_size), len(problem.counts)), dtype=np.int64)
    counts[col.pairs[:, 1], col.pairs[:, 0]] = np.rint(np.asarray(highs.getSolution().col_value[: col.num_a]))
    used = counts.sum(axis=1) > 0
    sizes = col.slot_size[used]
    makespan = float(group_times(problem, sizes, counts[used]).max())
    optimal = highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
    solution = SlotSolution(tuple(sizes.tolist()), counts[used], makespan, optimal)
    return warm if warm is not None and warm.makespan_s < solution.makespan_s else solution


def _as_columns(problem: BucketProblem, solution: SlotSolution, col: _Columns) -> np.ndarray:
    """A homogeneous solution as MILP column values: its groups, heaviest first, in the slots of its size."""
    x = np.zeros(col.makespan + 1)
    first = int(np.searchsorted(col.slot_size, solution.sizes[0]))
    loads = group_times(problem, np.asarray(solution.sizes), solution.counts)
    a_index = {(int(k), int(p)): i for i, (k, p) in enumerate(col.pairs)}
    for g, row in enumerate(solution.counts[np.argsort(-loads, kind="stable")]):
        x[col.m[first + g]] = 1.0
        for k in np.flatnonzero(row):
            x[a_index[(int(k), first + g)]] = row[k]
    x[-1] = solution.makespan_s
    return x
