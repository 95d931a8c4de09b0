"""The interface between cost models and everything that prices a plan: planners and the simulator.

Planners and `simulate` see a cost model only through `CostModel`, so a model of another form (a lookup
table, a learned predictor) plugs in without touching them. Times are vectorised over samples: a model
first turns samples into a per-sample `work` array (`sample_work`) that its other methods take back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from megatron_dhp.cost.config import Domain
from megatron_dhp.cost.encoder import EncoderPhase
from megatron_dhp.plan.memory import Footprint, MemoryRule
from megatron_dhp.plan.shares import Pace
from megatron_dhp.workload.sample import Sample


class CostModel(Protocol):
    """Seconds of samples and microbatches on groups of ranks, memory feasibility, and the step lower bound."""

    domain: Domain
    """The ranks, their nodes, their speeds and the per-rank token cap M the model prices."""
    step_overhead_s: float
    """sigma: fixed seconds every step pays before its first microbatch, on every rank."""
    encoder_placement: str
    """Where the vision encoder runs (`plan.encoder.ENCODER_PLACEMENTS`); `auto` is resolved by the planner."""
    uneven_shards: bool
    """Whether groups of ranks at different speeds split samples by speed (`group_shares`); the bounds allow
    for it."""

    def with_placement(self, placement: str) -> CostModel:
        """The same model with the encoder run as `placement`."""
        ...

    def encoder_time(self, samples: Sequence[Sample], degree: np.ndarray | int) -> np.ndarray:
        """Seconds of each sample's encoder work inside its group of `degree` ranks (part of `sample_time`;
        broadcasts over an array of each sample's group size)."""
        ...

    def encoder_phase(self, samples: Sequence[Sample], *, bound: bool = False) -> EncoderPhase:
        """The step's encoder time outside every group (before the first, after the last microbatch);
        `bound`: a lower bound on it."""
        ...

    def attention_time(self, samples: Sequence[Sample], degree: np.ndarray | int) -> np.ndarray:
        """Seconds of each sample's attention inside its group of `degree` ranks at speed 1: the quadratic part
        of `sample_time` (the LLM's, and the encoder's where the group runs it; broadcasts like `encoder_time`),
        which `CostConfig.scaled` may scale apart and the closed loop fits a factor of its own to."""
        ...

    def sample_work(self, samples: Sequence[Sample]) -> np.ndarray:
        """Per-sample figure the time methods take back (in the reference model, compute seconds on one rank)."""
        ...

    def sample_time(self, tokens: np.ndarray, work: np.ndarray, degree: np.ndarray | int, intra: np.ndarray | bool,
                    speed: np.ndarray | float = 1.0, *, slowest: np.ndarray | float | None = None,
                    comm_scale: np.ndarray | float = 1.0) -> np.ndarray:
        """t(L, d): seconds each sample takes on a group of `degree` ranks, inside one node or not, whose
        split compute runs at `speed` (its slowest member at `slowest`, default `speed`, its comm
        `comm_scale` times the even split's: a `plan.shares.Pace`; broadcasts)."""
        ...

    def group_speed(self, ranks: Sequence[int]) -> float:
        """The speed a group of these domain positions computes at (its slowest rank's; 1.0 when nominal)."""
        ...

    def group_pace(self, ranks: Sequence[int], shares: Sequence[int] = ()) -> Pace:
        """How fast a group of these ranks runs with `shares` (empty: even shards, at its slowest's speed)."""
        ...

    def group_shares(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The shares a planner gives a group of these ranks (empty: even)."""
        ...

    def with_speeds(self, speeds: tuple[float, ...]) -> CostModel:
        """The same model with the domain's ranks at `speeds` (empty: every rank at 1, the speed-blind model)."""
        ...

    def time_table(self, tokens: np.ndarray, work: np.ndarray, degrees: np.ndarray) -> np.ndarray:
        """(samples, degrees): t(L_i, d) of every sample on every group size, each group at its best placement."""
        ...

    def best_time(self, tokens: np.ndarray, work: np.ndarray, *, lo: np.ndarray | int, hi: int,
                  speed: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """min over d in [lo, hi] of t(L, d) at the best placement (on ranks at `speed`), and the smallest d
        that attains it."""
        ...

    def is_intra(self, ranks: Sequence[int]) -> bool:
        """Whether a group's ranks all sit on one node."""
        ...

    def memory_rule(self) -> MemoryRule:
        """The per-rank token cap and how encoder activations count against it (`plan.memory`)."""
        ...

    def footprint(self, samples: Sequence[Sample]) -> Footprint:
        """Each sample's memory under `memory_rule` on this domain (its `min_degree`, its load in a microbatch)."""
        ...

    def microbatch_overhead(self, group_size: int, speed: float = 1.0) -> float:
        """Fixed seconds of one microbatch on a group of `group_size` ranks whose slowest runs at `speed`;
        `microbatch_overhead(1)` is the base m that every microbatch pays, larger groups may pay more (lambda)."""
        ...

    def microbatch_time(self, samples: Sequence[Sample], ranks: Sequence[int], shares: Sequence[int] = ()) -> float:
        """Seconds of one microbatch of `samples` on `ranks` with `shares`: its overhead plus its samples' times."""
        ...

    def with_token_cap(self, max_tokens_per_rank: int) -> CostModel:
        """The same model on a domain whose per-rank token cap is `max_tokens_per_rank` (how planners that do
        not plan for pipeline parallelism are given 1F1B's in-flight memory)."""
        ...

    def lower_bound(self, samples: Sequence[Sample]) -> float:
        """A step time no plan of these samples can beat, step overhead included."""
        ...

    def lower_bound_arrays(self, tokens: np.ndarray, work: np.ndarray, footprint: Footprint) -> float:
        """`lower_bound` without the step overhead, from token counts, `sample_work` and `footprint` (for
        planners that compare it with their own makespans)."""
        ...
