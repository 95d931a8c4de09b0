"""Fit a `kind: profiled` cost model to measured microbatch times.

The fit is a least-squares fit of the reference form (docs/cost-model.md, overlap_comm false, since
gloo collectives block), relative to each measurement so that short microbatches count as much as long:

    T(L, d, k) = m + lambda [d > 1] + k (s + (a L^2 + b L) / d + c L (d - 1) / d)

where c = gamma / bw is what the data determine about communication, and s (`sample_overhead_s`) and
lambda (`cp_microbatch_overhead_s`) are the cost model's optional terms for per-sample work every rank of a
group repeats and the collective latency of a multi-rank microbatch (docs/cost-model.md). Coefficients are kept
non-negative by an exact non-negative least-squares fit (`fit`).

The measurements are of microbatch shapes (`GridPoint`); `default_grid` picks shapes that separate the terms.
The third optional term, the step overhead sigma (`step_overhead_s`), is what a whole step adds to its
microbatches, which no single microbatch shows: `step_overhead` sets it from steps measured against the fit.

Pure: the timing that produces the measurements lives in `megatron_dhp.training`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_dhp.cost.config import TOKEN_KEYS, CostConfig

TERMS = ("microbatch_overhead_s", "cp_microbatch_overhead_s", "sample_overhead_s", "attn_s_per_token2",
         "linear_s_per_token", "comm_s_per_token")
"""The fitted coefficients m, lambda, s, a, b, c, in the order of a `GridPoint`'s features."""

SAMPLE_COUNTS = (1, 2, 4, 8, 16)
"""Samples per microbatch at each grid length (where they fit): one rank's points then separate the linear
term b from the per-sample s and the fixed m, and a group's points separate b / d from communication."""

NOMINAL_BYTES_PER_S = 1.0e9
"""The bandwidth written into a profiled YAML: the fit determines gamma / bw, so gamma is reported for it."""


@dataclass(frozen=True)
class GridPoint:
    """One microbatch shape: `samples` samples of `length` tokens on groups of `group_size` ranks, or, when
    `drawn` is set, samples of those lengths (a microbatch packed from the job's own data)."""

    length: int
    group_size: int
    samples: int = 1
    drawn: tuple[int, ...] = ()
    """The sample lengths of a data point (then `length` is the longest and `samples` their count)."""

    @classmethod
    def from_data(cls, lengths: Sequence[int], group_size: int) -> GridPoint:
        """A point of the given sample lengths, as the job's data packs them."""
        return cls(max(lengths), group_size, len(lengths), tuple(int(L) for L in lengths))

    @property
    def lengths(self) -> tuple[int, ...]:
        """The sample lengths of the point's microbatch."""
        return self.drawn or (self.length,) * self.samples

    def describe(self) -> str:
        """The point's samples in a few characters: `4 x 128`, or `5 of 27-191 (data)`."""
        if self.drawn:
            return f"{self.samples} of {min(self.drawn)}-{self.length} (data)"
        return f"{self.samples} x {self.length}"

    def features(self) -> np.ndarray:
        """The point's row of the fit (per microbatch): coefficients of m, lambda, s, a, b, c."""
        d, lengths = float(self.group_size), self.lengths
        tokens = float(sum(lengths))
        return np.array([1.0, float(d > 1), len(lengths), sum(L * L for L in lengths) / d, tokens / d,
                         tokens * (d - 1) / d])


def default_grid(*, num_ranks: int, max_tokens_per_rank: int, lengths: tuple[int, ...] = ()) -> list[GridPoint]:
    """Lengths (default: powers of two from 64 to the domain's capacity) x group sizes 1..n, each packed
    `SAMPLE_COUNTS` to a microbatch where that fits, so that m, s and the token terms separate."""
    cap = max_tokens_per_rank
    if not lengths:
        lengths = tuple(2**i for i in range(6, 40) if 2**i <= num_ranks * cap)
    return [GridPoint(L, d, k) for d in range(1, num_ranks + 1) for L in lengths for k in SAMPLE_COUNTS
            if k * L <= d * cap]


def fit(grid: list[GridPoint], measured: list[float], *, terms: tuple[str, ...] = TERMS) -> dict[str, float]:
    """Non-negative relative least squares of `measured` on the grid's features; unused terms are 0.

    Exact: the non-negative optimum is the least-squares fit on some subset of the terms whose coefficients
    all come out non-negative, the one with the smallest residual, and six terms make 63 subsets to try.
    (Dropping the most negative term and refitting can drop one the data need, e.g. b when gloo's
    collectives also grow with L.) Only subsets with a token term (`config.TOKEN_KEYS`) count: a model whose tokens
    take no time prices no step against its bound (`CostConfig` refuses it), and a tiny model whose
    microbatches are all overhead would otherwise fit one. One such subset always fits (b alone: positive
    features and times give a positive coefficient)."""
    x = np.stack([p.features() for p in grid])
    y = np.asarray(measured, dtype=np.float64)
    w = x / y[:, None]
    target = np.ones_like(y)
    usable = [i for i, name in enumerate(TERMS) if name in terms]
    best: tuple[float, list[int], np.ndarray] | None = None
    for mask in range(1, 1 << len(usable)):
        active = [i for j, i in enumerate(usable) if mask >> j & 1]
        if not any(TERMS[i] in TOKEN_KEYS for i in active):
            continue
        coef, *_ = np.linalg.lstsq(w[:, active], target, rcond=None)
        if (coef < 0).any():
            continue
        residual = float(np.sum((w[:, active] @ coef - target) ** 2))
        if best is None or residual < best[0] - 1e-15:
            best = (residual, active, coef)
    out = dict.fromkeys(TERMS, 0.0)
    if best is not None:
        for i, c in zip(best[1], best[2]):
            out[TERMS[i]] = float(c)
    return out


def predict(grid: list[GridPoint], coefficients: dict[str, float]) -> np.ndarray:
    """The fitted seconds of every grid point."""
    c = np.array([coefficients[name] for name in TERMS])
    return np.stack([p.features() for p in grid]) @ c


def profiled_cost(coefficients: dict[str, float], *, world_size: int, gpus_per_node: int, max_tokens_per_rank: int,
                  description: str) -> CostConfig:
    """The `kind: profiled` cost config of fitted `coefficients` on a domain (no step overhead yet)."""
    c = coefficients
    return CostConfig(
        kind="profiled", world_size=world_size, gpus_per_node=gpus_per_node, max_tokens_per_rank=max_tokens_per_rank,
        attn_s_per_token2=c["attn_s_per_token2"], linear_s_per_token=c["linear_s_per_token"],
        microbatch_overhead_s=c["microbatch_overhead_s"], comm_bytes_per_token=c["comm_s_per_token"] * NOMINAL_BYTES_PER_S,
        intra_node_bytes_per_s=NOMINAL_BYTES_PER_S, inter_node_bytes_per_s=NOMINAL_BYTES_PER_S, overlap_comm=False,
        sample_overhead_s=c["sample_overhead_s"], cp_microbatch_overhead_s=c["cp_microbatch_overhead_s"],
        description=description,
    )


def step_overhead(steps: Sequence[tuple[float, float]]) -> float:
    """sigma: the median over (predicted, measured) steps of measured - predicted, at least 0 (the median
    keeps a step slowed by load from elsewhere from setting it)."""
    gaps = [measured - predicted for predicted, measured in steps]
    return max(0.0, statistics.median(gaps)) if gaps else 0.0
