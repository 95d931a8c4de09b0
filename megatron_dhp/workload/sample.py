"""Samples and batches: the unit of work every planner assigns."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_dhp.errors import DhpError


@dataclass(frozen=True)
class Sample:
    """One training sequence.

    `tokens` is the total LLM sequence length (text plus image tokens); `images` lists the vision-encoder
    token count of each image or video clip the sample carries, which only the encoder cost terms use.
    """

    id: int
    tokens: int
    images: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Every rule a sample obeys, whoever builds it; readers of files and plans add where it came from."""
        if not _is_int(self.id) or self.id < 0:
            raise DhpError(f"sample id {self.id!r} must be a non-negative integer")
        if not _is_int(self.tokens) or self.tokens < 1:
            raise DhpError(f"length {self.tokens!r} must be a positive integer number of tokens")
        images = tuple(self.images)
        for p in images:
            if not _is_int(p) or p < 1:
                raise DhpError(f"image token count {p!r} must be a positive integer")
        if sum(images) > self.tokens:
            raise DhpError(
                f"images hold {sum(images)} tokens, more than the sample's {self.tokens}; "
                "'tokens' is the total LLM length including image tokens"
            )
        object.__setattr__(self, "id", int(self.id))
        object.__setattr__(self, "tokens", int(self.tokens))
        object.__setattr__(self, "images", tuple(int(p) for p in images))

    def to_dict(self) -> dict:
        """The plan-JSON form: `images` only when present."""
        out: dict = {"id": self.id, "tokens": self.tokens}
        if self.images:
            out["images"] = list(self.images)
        return out

    @classmethod
    def from_dict(cls, obj: dict) -> Sample:
        """Parse the plan-JSON form."""
        if not isinstance(obj, dict) or "id" not in obj or "tokens" not in obj:
            raise DhpError(f"sample entry {obj!r} needs 'id' and 'tokens'")
        try:
            return cls(id=obj["id"], tokens=obj["tokens"], images=tuple(obj.get("images", ())))
        except DhpError as e:
            raise DhpError(f"sample entry {obj!r}: {e}") from None


@dataclass(frozen=True)
class Batch:
    """The samples of one global batch and the seed they were drawn with (None: taken as given)."""

    samples: tuple[Sample, ...]
    seed: int | None = None
    _by_id: dict[int, Sample] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        samples = tuple(self.samples)
        if not samples:
            raise DhpError("the batch is empty: give at least one sample (check --global-batch and the length source)")
        by_id: dict[int, Sample] = {}
        for s in samples:
            if s.id in by_id:
                raise DhpError(f"sample id {s.id} appears twice in the batch; ids must be unique")
            by_id[s.id] = s
        object.__setattr__(self, "samples", samples)
        object.__setattr__(self, "_by_id", by_id)

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], *, seed: int | None = None) -> Batch:
        """A text-only batch whose sample ids are the positions in `lengths`."""
        return cls(tuple(Sample(i, int(n)) for i, n in enumerate(lengths)), seed=seed)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, sample_id: int) -> Sample:
        return self._by_id[sample_id]

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._by_id

    @property
    def ids(self) -> list[int]:
        """Sample ids in batch order."""
        return [s.id for s in self.samples]

    @property
    def lengths(self) -> np.ndarray:
        """Token counts in sample order, as int64."""
        return np.fromiter((s.tokens for s in self.samples), dtype=np.int64, count=len(self.samples))

    @property
    def num_tokens(self) -> int:
        """Tokens over the whole batch."""
        return sum(s.tokens for s in self.samples)

    def subset(self, ids: Sequence[int]) -> list[Sample]:
        """The samples with these ids, in the order given."""
        return [self._by_id[i] for i in ids]


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
