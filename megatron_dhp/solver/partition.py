"""Optimal splits of a sorted list into contiguous runs, by dynamic programming over cut points.

FlexSP uses two such DPs: the Sequence Blaster cuts the length-sorted batch into microbatches minimising
the largest token sum (runs combine by max), and bucketing cuts the sorted lengths into buckets minimising
the total padding (runs combine by sum). Both are `PartitionDP` with a different run cost and combiner.
Each layer (one more run) is one vectorised O(n^2) step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np


class PartitionDP:
    """Best splits of items 0..n-1 into k non-empty contiguous runs, layer by layer in k.

    `run_cost[j, i]` is the cost of the run of items j..i-1 (only j < i is read); `combine` folds run costs
    (np.maximum or np.add). Ties go to the earliest cut, so splits are deterministic.
    """

    def __init__(self, run_cost: np.ndarray, combine: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        self.n = run_cost.shape[0] - 1
        upper = np.triu(np.ones_like(run_cost, dtype=bool), k=1)  # j < i
        self._cost = np.where(upper, run_cost, np.inf)
        self._combine = combine
        self._best = [np.where(np.arange(self.n + 1) == 0, 0.0, np.inf)]  # zero runs cover zero items
        self._cut: list[np.ndarray] = [np.zeros(self.n + 1, dtype=np.int64)]

    def layers(self, max_parts: int) -> Iterator[tuple[int, float]]:
        """(k, cost of the best split into k runs) for k = 1 .. min(max_parts, n), computing as it goes."""
        for k in range(1, min(max_parts, self.n) + 1):
            while len(self._best) <= k:
                cand = self._combine(self._best[-1][:, None], self._cost)
                self._cut.append(np.argmin(cand, axis=0))
                self._best.append(cand[self._cut[-1], np.arange(self.n + 1)])
            yield k, float(self._best[k][self.n])

    def cuts(self, parts: int) -> list[int]:
        """Run boundaries [0, c1, ..., n] of the best split into `parts` runs."""
        for _ in self.layers(parts):
            pass
        bounds = [self.n]
        for k in range(parts, 0, -1):
            bounds.append(int(self._cut[k][bounds[-1]]))
        return bounds[::-1]


def max_sum_partition(values: np.ndarray, parts: int) -> list[int]:
    """Boundaries of `parts` contiguous runs of `values` minimising the largest run sum."""
    prefix = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    return PartitionDP(prefix[None, :] - prefix[:, None], np.maximum).cuts(parts)


def padding_cost(sorted_lengths: np.ndarray) -> np.ndarray:
    """run_cost[j, i]: tokens of padding when items j..i-1 (ascending) are all padded to item i-1's length."""
    n = len(sorted_lengths)
    prefix = np.concatenate([[0.0], np.cumsum(sorted_lengths, dtype=np.float64)])
    top = np.concatenate([[0.0], np.asarray(sorted_lengths, dtype=np.float64)])  # top[i] = length of item i-1
    count = np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None]
    return count * top[None, :] - (prefix[None, :] - prefix[:, None])
