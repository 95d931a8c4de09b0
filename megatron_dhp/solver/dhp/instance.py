"""One planning problem as flat numpy arrays, with the per-group-size time tables the search reuses."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.workload.sample import Batch


@dataclass
class Instance:
    """A batch under a cost model: ids, tokens, work and minimum degree of every sample."""

    model: CostModel
    ids: np.ndarray
    tokens: np.ndarray
    work: np.ndarray
    min_degree: np.ndarray
    cap: int
    """Per-rank tokens one microbatch may hold: M, or M // P under pipeline parallelism."""
    _times: dict[tuple[int, bool], np.ndarray] = field(default_factory=dict, repr=False)
    _index: dict[int, int] = field(default_factory=dict, repr=False)

    @classmethod
    def from_batch(cls, batch: Batch, model: CostModel, cap: int | None = None) -> Instance:
        """Flatten the batch; every array is in batch order. `cap` (default M) bounds each microbatch."""
        tokens = batch.lengths
        return cls(
            model=model,
            ids=np.array(batch.ids, dtype=np.int64),
            tokens=tokens,
            work=model.sample_work(batch.samples),
            min_degree=np.maximum(1, model.min_degree(tokens) if cap is None else -(-tokens.astype(np.int64) // cap)),
            cap=cap or model.domain.max_tokens_per_rank,
        )

    @property
    def num_ranks(self) -> int:
        """N, the ranks of the dynamic domain."""
        return self.model.domain.world_size

    def overhead(self, size: int) -> float:
        """The fixed cost of one microbatch on a group of `size` ranks (m, plus any multi-rank latency)."""
        return self.model.microbatch_overhead(size)

    def times(self, size: int, intra: bool) -> np.ndarray:
        """t(L, size) of every sample on a group of `size` ranks, cached per (size, placement)."""
        key = (size, intra)
        if key not in self._times:
            self._times[key] = self.model.sample_time(self.tokens, self.work, size, intra)
        return self._times[key]

    def microbatch_times(self, group: PlanGroup) -> tuple[float, ...]:
        """Seconds of each of a planned group's microbatches (overhead plus its samples), from the tables."""
        if not self._index:
            self._index.update((int(i), k) for k, i in enumerate(self.ids))
        t, m = self.times(group.size, self.model.is_intra(group.ranks)), self.overhead(group.size)
        return tuple(m + float(t[[self._index[i] for i in mb]].sum()) for mb in group.microbatches)
