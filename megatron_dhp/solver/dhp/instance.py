"""One planning problem as flat numpy arrays, with the per-group-size time tables the search reuses."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.workload.sample import Batch


@dataclass
class Instance:
    """A batch under a cost model: ids, tokens, work and minimum degree of every sample."""

    model: CostModel
    ids: np.ndarray
    tokens: np.ndarray
    work: np.ndarray
    min_degree: np.ndarray
    _times: dict[tuple[int, bool], np.ndarray] = field(default_factory=dict, repr=False)

    @classmethod
    def from_batch(cls, batch: Batch, model: CostModel) -> Instance:
        """Flatten the batch; every array is in batch order."""
        tokens = batch.lengths
        return cls(
            model=model,
            ids=np.array(batch.ids, dtype=np.int64),
            tokens=tokens,
            work=model.sample_work(batch.samples),
            min_degree=np.maximum(1, model.min_degree(tokens)),
        )

    @property
    def num_ranks(self) -> int:
        """N, the ranks of the dynamic domain."""
        return self.model.domain.world_size

    @property
    def cap(self) -> int:
        """M, the per-rank token cap."""
        return self.model.domain.max_tokens_per_rank

    def overhead(self, size: int) -> float:
        """The fixed cost of one microbatch on a group of `size` ranks (m, plus any multi-rank latency)."""
        return self.model.microbatch_overhead(size)

    def times(self, size: int, intra: bool) -> np.ndarray:
        """t(L, size) of every sample on a group of `size` ranks, cached per (size, placement)."""
        key = (size, intra)
        if key not in self._times:
            self._times[key] = self.model.sample_time(self.tokens, self.work, size, intra)
        return self._times[key]
