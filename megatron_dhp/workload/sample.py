"""Samples and batches: the unit of work every planner assigns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.files import INT64_MAX


@dataclass(frozen=True)
class VisualItem:
    """One image or video a sample carries, as the encoder and the LLM each see it.

    A vision encoder turns `enc` patches into `llm` tokens of the sample (2x2 merge, pixel shuffle: about
    enc / 4), and attends only inside each of its `blocks` (a tile, a frame, a temporal slice), so its cost is
    priced per block and an item's encoder tokens may well exceed its sample's LLM length.
    """

    enc: int
    """Vision-encoder tokens (patches) of the item."""
    llm: int
    """LLM tokens the item occupies inside its sample's `tokens`."""
    blocks: tuple[int, ...] = ()
    """Lengths of the encoder's independent attention blocks, summing to `enc`; () means one block (enc,)."""

    def __post_init__(self) -> None:
        for name in ("enc", "llm"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise DhpError(f"visual item {name} = {excerpt(value)} must be a positive integer number of tokens")
        if isinstance(self.blocks, (str, bytes)) or not isinstance(self.blocks, Iterable):
            raise DhpError(f"visual item blocks {excerpt(self.blocks)} must be a list of encoder token counts")
        blocks = tuple(self.blocks) or (self.enc,)
        for b in blocks:
            if not _is_int(b) or b < 1:
                raise DhpError(f"visual item block {excerpt(b)} must be a positive integer number of encoder tokens")
        if sum(blocks) != self.enc:
            raise DhpError(f"visual item blocks {excerpt(list(blocks))} sum to {sum(blocks)}, not to its {self.enc} encoder tokens")
        object.__setattr__(self, "enc", int(self.enc))
        object.__setattr__(self, "llm", int(self.llm))
        object.__setattr__(self, "blocks", tuple(int(b) for b in blocks))

    @classmethod
    def short(cls, enc: int, merge: int) -> VisualItem:
        """The short form: `enc` encoder tokens in one block, ceil(enc / merge) LLM tokens."""
        if not _is_int(enc) or enc < 1:
            raise DhpError(f"image token count {excerpt(enc)} must be a positive integer")
        return cls(enc, -(-int(enc) // merge))

    def to_dict(self) -> dict:
        """The long form; `blocks` only when there is more than one."""
        out: dict = {"enc": self.enc, "llm": self.llm}
        if len(self.blocks) > 1:
            out["blocks"] = list(self.blocks)
        return out

    @classmethod
    def from_obj(cls, obj: object, merge: int) -> VisualItem:
        """An item from either file form: a bare encoder token count, or {"enc", "llm", "blocks"}."""
        if isinstance(obj, dict):
            unknown = set(obj) - {"enc", "llm", "blocks"}
            if unknown:
                raise DhpError(f"visual item {excerpt(obj)} has unknown key {excerpt(sorted(unknown)[0])} (allowed: enc, llm, blocks)")
            if "enc" not in obj or "llm" not in obj:
                raise DhpError(f"visual item {excerpt(obj)} needs 'enc' and 'llm'")
            return cls(obj["enc"], obj["llm"], obj.get("blocks", ()))
        if not _is_int(obj):
            raise DhpError(f"visual item {excerpt(obj)} must be an encoder token count or an object "
                           '{"enc": P, "llm": Q, "blocks": [...]}')
        return cls.short(obj, merge)


@dataclass(frozen=True)
class Sample:
    """One training sequence.

    `tokens` is the total LLM sequence length (text plus the visual items' LLM tokens); `images` lists the
    visual items (images, tiles, videos) the sample carries, which only the encoder cost terms and the
    runtime's encoder use.
    """

    id: int
    tokens: int
    images: tuple[VisualItem, ...] = ()

    def __post_init__(self) -> None:
        """Every rule a sample obeys, whoever builds it; readers of files and plans add where it came from."""
        if not _is_int(self.id) or self.id < 0:
            raise DhpError(f"sample id {excerpt(self.id)} must be a non-negative integer")
        if not _is_int(self.tokens) or self.tokens < 1:
            raise DhpError(f"length {excerpt(self.tokens)} must be a positive integer number of tokens")
        images = tuple(self.images)
        for item in images:
            if not isinstance(item, VisualItem):
                raise DhpError(f"sample {self.id}: image {excerpt(item)} must be a VisualItem (VisualItem.short(P, merge) "
                               "for P encoder tokens)")
        llm = sum(item.llm for item in images)
        if llm > self.tokens:
            raise DhpError(
                f"sample {self.id}: images take {llm} LLM tokens, more than the sample's {self.tokens}; "
                "'tokens' is the total LLM length including image tokens"
            )
        object.__setattr__(self, "id", int(self.id))
        object.__setattr__(self, "tokens", int(self.tokens))
        object.__setattr__(self, "images", images)

    def to_dict(self) -> dict:
        """The plan-JSON form: `images` (long form) only when present."""
        out: dict = {"id": self.id, "tokens": self.tokens}
        if self.images:
            out["images"] = [item.to_dict() for item in self.images]
        return out

    @classmethod
    def from_dict(cls, obj: dict, merge: int = 4) -> Sample:
        """Parse the plan-JSON form; an image is a long-form object or a short-form encoder token count."""
        if not isinstance(obj, dict) or "id" not in obj or "tokens" not in obj:
            raise DhpError(f"sample entry {excerpt(obj)} needs 'id' and 'tokens'")
        try:
            images = obj.get("images", ())
            if not isinstance(images, (list, tuple)):
                raise DhpError(f"'images' must be a list, got {excerpt(images)}")
            return cls(id=obj["id"], tokens=obj["tokens"], images=tuple(VisualItem.from_obj(p, merge) for p in images))
        except DhpError as e:
            raise DhpError(f"sample entry {excerpt(obj)}: {e}") from None


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


def _is_int(x: object) -> bool:
    """An integer int64 holds (lengths and ids become numpy int64)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and abs(int(x)) <= INT64_MAX
