"""Drawing global batches deterministically from a length source, and checking they fit the domain."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.workload.sample import Batch, Sample, VisualItem
from megatron_dhp.workload.sources import load_samples, too_many_samples
from megatron_dhp.workload.synthetic import Distribution, get_distribution

MAX_BATCH_SAMPLES = 262_144
"""The most samples one global batch may hold: 64 times the largest batch real recipes draw (4096), and still
planned in seconds; a length file of millions of samples taken whole would plan for minutes, silently."""


@dataclass(frozen=True)
class LengthSource:
    """Either a file of samples or a named distribution; `name` is what reports print."""

    name: str
    samples: tuple[Sample, ...] = ()
    distribution: Distribution | None = None

    @classmethod
    def from_args(cls, *, lengths: str | Path | None = None, dist: str | None = None, merge: int = 4,
                  whole: bool = False) -> LengthSource:
        """The source named by `--lengths FILE` or `--dist NAME` (exactly one); `merge` (the cost config's)
        gives a file's short-form images their LLM tokens. `whole`: the file will be drawn whole as one batch
        (no --global-batch), so one over `MAX_BATCH_SAMPLES` is refused as soon as its entries are counted."""
        if (lengths is None) == (dist is None):
            raise DhpError("give exactly one of --lengths FILE and --dist NAME")
        if lengths is not None:
            limit = MAX_BATCH_SAMPLES if whole else None
            return cls(name=Path(lengths).name, samples=tuple(load_samples(lengths, merge=merge, max_samples=limit)))
        return cls(name=dist, distribution=get_distribution(dist))

    def draw(self, *, global_batch: int | None, seed: int, index: int = 0, capacity: int) -> Batch:
        """Batch `index` of the run seeded with `seed`; ids are positions in the batch.

        A file without `global_batch` is taken whole, ids in file order. Otherwise samples are drawn
        from a generator seeded with (seed, index), without replacement while the file is large enough.
        Either way a batch holds at most `MAX_BATCH_SAMPLES`.
        """
        if global_batch is not None and (isinstance(global_batch, bool) or global_batch < 1):
            raise DhpError(f"--global-batch {excerpt(global_batch)} must be a positive integer")
        if global_batch is not None and global_batch > MAX_BATCH_SAMPLES:
            raise DhpError(f"--global-batch {global_batch:,} is more samples than a batch may hold "
                           f"({MAX_BATCH_SAMPLES:,}); pass --global-batch {MAX_BATCH_SAMPLES} or less")
        if self.distribution is None and global_batch is None:
            if len(self.samples) > MAX_BATCH_SAMPLES:
                raise too_many_samples(self.name, len(self.samples), MAX_BATCH_SAMPLES)
            return Batch(self.samples, seed=None)
        if global_batch is None:
            raise DhpError(f"distribution {self.name!r} needs --global-batch (how many samples per batch)")
        rng = np.random.default_rng([seed, index])
        if self.distribution is not None:
            return Batch(tuple(self.distribution.draw(rng, global_batch, capacity=capacity)), seed=seed)
        picks = rng.choice(len(self.samples), size=global_batch, replace=global_batch > len(self.samples))
        return Batch(tuple(replace(self.samples[j], id=i) for i, j in enumerate(picks)), seed=seed)

    def max_tokens(self) -> int | None:
        """The longest sample of a file source (None for a distribution)."""
        return max(s.tokens for s in self.samples) if self.samples else None


def fit_to_domain(batch: Batch, capacity: int, *, truncate: bool = False) -> Batch:
    """Reject (or, with `truncate`, cut) samples longer than the domain's capacity N x M.

    `run_planner` rejects, for every planner; a data pipeline cuts when the user asked for `truncate`.
    """
    too_long = [s for s in batch.samples if s.tokens > capacity]
    if not too_long:
        return batch
    if not truncate:
        s = too_long[0]
        raise DhpError(
            f"sample {s.id} has {s.tokens} tokens but the whole domain holds at most {capacity} "
            f"(world_size x max_tokens_per_rank, over the pipeline stages under PP); raise --world-size or --max-tokens-per-rank, "
            f"or pass --truncate to cut {len(too_long)} such sample(s)"
        )
    return Batch(tuple(truncate_sample(s, capacity) for s in batch.samples), seed=batch.seed)


def truncate_sample(sample: Sample, max_tokens: int) -> Sample:
    """Cut a sample to `max_tokens`, keeping the leading visual items whose LLM tokens still fit whole."""
    if sample.tokens <= max_tokens:
        return sample
    kept: list[VisualItem] = []
    for item in sample.images:
        if sum(k.llm for k in kept) + item.llm > max_tokens:
            break
        kept.append(item)
    return Sample(sample.id, max_tokens, tuple(kept))
