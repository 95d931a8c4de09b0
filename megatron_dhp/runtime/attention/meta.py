"""What a microbatch's attention needs, built once when the microbatch is laid out and read by every layer.

A layer on the GPU must not wait for the host: no `.item()`, `.tolist()` or `nonzero` on a device tensor, no
host-built index or mask copied in, no Python loop over tokens. Everything attention reads is a fact of the
microbatch's `MicrobatchLayout` (its samples, group and rank), the same for every layer, forward and backward,
so `AttentionMeta.build` computes it once, on the host from Python ints, and moves it to the device in one
pinned, non-blocking copy. A layer then reads only:

- host ints: where each sample's rows start and how many there are (`Spans.starts`, `Spans.lengths`): what a
  CPU kernel slices by and a varlen kernel takes as its maximum length;
- device tensors: cumulative lengths (`Spans.cu`, int32 as flash attention takes them), each local row's true
  position and sample, and for a group of d > 1 the rows of each sample's two zigzag chunks.

With zigzag halves every ring step is, sample by sample, one of three blocks (`RING_BLOCKS`): at step 0 the
rank's own shard attends itself causally (its rows are in position order); from a rank before it in the group
(source s < r) every query sees that rank's front chunk and nothing of its back chunk; from a rank after it
(s > r) only the back chunk's queries see anything, and they see the whole block. So no ring step needs a mask.
This holds for uneven shards too (front chunks in rank order from the start, back chunks in reverse order from
the end, whatever their lengths), where a block's rows are those of its source rank (`RingBlock.keys`): under
even shards every rank's shard has this rank's shape, and one `Shard` serves every step.
Everything here is O(samples + tokens): never O(tokens^2). Backends may cache what they derive from it
(`cache`) with device operations only, so even that costs no host round-trip.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dhp.runtime.fused import DeviceZigzag, zigzag_on
from megatron_dhp.runtime.host import to_device
from megatron_dhp.runtime.layout import MicrobatchLayout

DIAGONAL, FRONT_KEYS, BACK_QUERIES = "diagonal", "front-keys", "back-queries"
RING_BLOCKS: tuple[str, ...] = (DIAGONAL, FRONT_KEYS, BACK_QUERIES)
"""The three kinds of ring step: the own block (causal), a block of an earlier group rank (queries x its front
chunks, full), a block of a later one (back-chunk queries x the whole block, full)."""


@dataclass(frozen=True, eq=False)
class Spans:
    """Packed sequences as a varlen kernel takes them: on the host, and as cumulative lengths on the device."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    cu: torch.Tensor
    """int32 [n + 1] on the device: 0, then the end of each sequence."""
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def max_len(self) -> int:
        """The longest sequence (a varlen kernel's `max_seqlen`)."""
        return max(self.lengths)

    @property
    def total(self) -> int:
        """Rows of all the sequences."""
        return sum(self.lengths)

    def slices(self) -> list[slice]:
        """Each sequence's rows."""
        return [slice(a, a + n) for a, n in zip(self.starts, self.lengths)]

    def row_segments(self) -> torch.Tensor:
        """int64 [total] on the device: which sequence each row belongs to (device operations only, cached)."""
        if "segments" not in self.cache:
            lengths = self.cu[1:] - self.cu[:-1]
            arange = torch.arange(len(self.lengths), device=self.cu.device)
            self.cache["segments"] = torch.repeat_interleave(arange, lengths, output_size=self.total)
        return self.cache["segments"]


@dataclass(frozen=True, eq=False)
class Shard:
    """One group rank's rows of a microbatch: each sample's shard, its front chunk then its back chunk, both
    `halves` long (a group of one: each sample whole). This rank's own holds its queries; another rank's is the
    keys of the ring step that brings its block."""

    spans: Spans
    """Each sample's shard."""
    halves: Spans | None
    """One chunk per sample: the rows of a ring step's front keys or back queries (d > 1)."""
    front_rows: torch.Tensor | None
    """int64: the rows of each sample's front chunk, sample by sample (d > 1)."""
    cache: dict[str, Any] = field(default_factory=dict)

    def front(self) -> torch.Tensor:
        """bool [rows] on the device: whether each row is in its sample's front chunk (device operations, cached)."""
        if "front" not in self.cache:
            segments = self.spans.row_segments()
            index = torch.arange(self.spans.total, device=segments.device) - self.spans.cu[segments]
            self.cache["front"] = index < (self.halves.cu[1:] - self.halves.cu[:-1])[segments]
        return self.cache["front"]


@dataclass(frozen=True, eq=False)
class RingBlock:
    """One ring step as a kernel computes it: its kind (`RING_BLOCKS`) and the rows of the K/V block in hand."""

    kind: str
    keys: Shard
    """The source rank's shard (this rank's own at the diagonal, and at every step under even shards)."""
    source: int | None
    """The source's group rank under uneven shards, where each block has its own shape; None under even ones
    (every block has this rank's): kernels cache what they derive for a step by its `name`."""

    @property
    def name(self) -> str:
        """The kind, and the source where blocks differ in shape."""
        return self.kind if self.source is None else f"{self.kind}-{self.source}"


@dataclass(frozen=True, eq=False)
class Runs:
    """This rank's rows as runs of consecutive positions (a group of d > 1: its front chunk, then its back chunk,
    of each sample; of one rank: each sample whole), each seeing its sample's first `first + rows` keys in
    position order (bottom-right causal): the all-gather's queries and keys."""

    queries: Spans
    """Each run's local rows."""
    keys: Spans
    """The keys each run sees, packed run after run."""
    firsts: tuple[int, ...]
    """Each run's first position."""
    key_starts: tuple[int, ...]
    """Where each run's sample starts in natural order (the group's rows after `zigzag_unpack`)."""
    key_starts_on_device: torch.Tensor
    """`key_starts`, int64 on the device."""


@dataclass(frozen=True, eq=False)
class AttentionMeta:
    """Everything one microbatch's attention reads, on its device, for every layer (see the module docstring)."""

    layout: MicrobatchLayout
    local: Spans
    """This rank's shard of each sample (the whole sample when the group is one rank)."""
    natural: Spans
    """Each padded sample whole, in position order: the group's rows after `zigzag_unpack` (Ulysses, all-gather)."""
    shards: tuple[Shard, ...]
    """Every group rank's `Shard` (one object for all under even shards)."""
    cu_seqlens: torch.Tensor
    """int32: cumulative true sample lengths (`PackedSeqParams.cu_seqlens_q`; `natural.cu` is the padded one)."""
    positions: torch.Tensor
    """int64 [t]: the true position of each local row (RoPE reads it too)."""
    segments: torch.Tensor
    """int64 [t]: the sample (index in the microbatch) of each local row."""
    back_rows: torch.Tensor | None
    """int64: the local rows of each sample's back chunk (d > 1)."""
    runs: Runs
    """This rank's runs of consecutive positions and the keys each sees."""
    group_runs: Spans
    """Every group rank's runs (as `runs.queries`), rank-major: the rows of an all-gather over the group."""
    group_firsts: torch.Tensor
    """int64 on the device: the first position of each of `group_runs`."""
    gather_keep: torch.Tensor | None
    """int64 on the device: the rows of an all-gather of blocks padded to the largest that hold some rank's rows
    (uneven shards; None: every rank holds as many rows)."""
    zigzag: DeviceZigzag
    """Every group rank's shards <-> natural order, its index tables on the device."""
    cache: dict[str, Any] = field(default_factory=dict)
    """What a backend derives from the above, once per microbatch, with device operations only."""

    @property
    def device(self) -> torch.device:  # noqa: D102
        return self.positions.device

    @property
    def shard(self) -> Shard:
        """This rank's `Shard`."""
        return self.shards[self.layout.rank]

    @property
    def halves(self) -> Spans | None:
        """One zigzag chunk per sample of this rank (d > 1)."""
        return self.shard.halves

    @property
    def front_rows(self) -> torch.Tensor | None:
        """int64: this rank's rows of each sample's front chunk (d > 1)."""
        return self.shard.front_rows

    def ring_block(self, step: int) -> RingBlock:
        """Ring step `step`: the block of group rank r - step (`RING_BLOCKS`)."""
        r, d = self.layout.rank, self.layout.group_size
        source = (r - step) % d
        kind = DIAGONAL if source == r else FRONT_KEYS if source < r else BACK_QUERIES
        return RingBlock(kind, self.shards[source], source if self.layout.uneven else None)

    def ring_rows(self, step: int) -> int:
        """Rows of the block this rank receives during ring step `step` (group rank r - step - 1's)."""
        layout = self.layout
        return layout.rank_slots[(layout.rank - step - 1) % layout.group_size]

    @classmethod
    def build(cls, layout: MicrobatchLayout, device: torch.device | str = "cpu") -> AttentionMeta:
        """The metadata of `layout` on `device`: computed on the host, moved in one non-blocking copy."""
        device = torch.device(device)
        d = layout.group_size
        own_runs = layout.runs()
        group_runs = [run for r in range(d) for run in layout.runs(r)]
        runs_per_sample = len(own_runs) // len(layout.lengths)
        key_starts = tuple(start for start in _starts(layout.padded_lengths) for _ in range(runs_per_sample))
        shard_ranks = range(d) if layout.uneven else (layout.rank,)  # even: every rank's shard has this one's shape
        parts: dict[str, torch.Tensor] = {  # the layout's own cumulative lengths (int32), in the int64 buffer
            "cu_seqlens": layout.cu_seqlens.long(),
            "natural": layout.cu_seqlens_padded.long(),
            "positions": layout.local_positions,
            "segments": layout.segments,
            "run_rows": _cu(tuple(c for _, c in own_runs)),
            "run_keys": _cu(tuple(f + c for f, c in own_runs)),
            "key_starts": torch.tensor(key_starts, dtype=torch.int64),
            "group_runs": _cu(tuple(c for _, c in group_runs)),
            "group_firsts": torch.tensor([f for f, _ in group_runs], dtype=torch.int64),
        }
        for r in shard_ranks:
            parts.update(_shard_parts(layout, r))
        if layout.uneven:  # an all-gather pads every block to the largest and keeps these rows
            width = max(layout.rank_slots)
            parts["gather_keep"] = _runs([r * width for r in range(d)], layout.rank_slots)
        moved = _to_device(parts, device)

        def spans(name: str, lengths: tuple[int, ...]) -> Spans:
            return Spans(tuple(_starts(lengths)), lengths, moved[name].int())

        shards = {}
        for r in shard_ranks:
            lengths = layout.local_lengths_of(r)
            halves = spans(f"halves{r}", tuple(c // 2 for c in lengths)) if d > 1 else None
            shards[r] = Shard(spans(f"shard{r}", lengths), halves, moved.get(f"front{r}"))
        own = shards[layout.rank]
        return cls(
            layout=layout,
            local=own.spans,
            natural=spans("natural", layout.padded_lengths),
            shards=tuple(shards.get(r, own) for r in range(d)),
            cu_seqlens=moved["cu_seqlens"].int(),
            positions=moved["positions"],
            segments=moved["segments"],
            back_rows=moved.get("back_rows"),
            runs=Runs(
                queries=spans("run_rows", tuple(c for _, c in own_runs)),
                keys=spans("run_keys", tuple(f + c for f, c in own_runs)),
                firsts=tuple(f for f, _ in own_runs), key_starts=key_starts,
                key_starts_on_device=moved["key_starts"],
            ),
            group_runs=spans("group_runs", tuple(c for _, c in group_runs)),
            group_firsts=moved["group_firsts"],
            gather_keep=moved.get("gather_keep"),
            zigzag=zigzag_on(layout.cu_seqlens_padded, d, None, device,
                             chunks=[layout.chunks(i) for i in range(len(layout.lengths))]),
        )

    def group_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, samples) of every group rank's rows, rank-major (an all-gather's order), derived on the
        device from `group_runs` (cached)."""
        if "group_rows" not in self.cache:
            runs, n = self.group_runs, len(self.layout.lengths)
            run = runs.row_segments()
            positions = torch.arange(runs.total, device=self.device) - runs.cu.long()[run] + self.group_firsts[run]
            per_sample = 2 if self.layout.group_size > 1 else 1
            self.cache["group_rows"] = (positions, run // per_sample % n)
        return self.cache["group_rows"]


def _shard_parts(layout: MicrobatchLayout, rank: int) -> dict[str, torch.Tensor]:
    """Group rank `rank`'s shard as `Shard` reads it: cumulative lengths of its samples' shards and chunks, the
    rows of its front chunks, and for this rank the rows of its back chunks."""
    lengths = layout.local_lengths_of(rank)
    parts = {f"shard{rank}": _cu(lengths)}
    if layout.group_size > 1:
        starts, halves = _starts(lengths), tuple(c // 2 for c in lengths)
        parts[f"halves{rank}"] = _cu(halves)
        parts[f"front{rank}"] = _runs(starts, halves)
        if rank == layout.rank:
            parts["back_rows"] = _runs([a + c for a, c in zip(starts, halves)], halves)
    return parts


def _starts(lengths: tuple[int, ...]) -> list[int]:
    return list(itertools.accumulate(lengths, initial=0))[:-1]


def _cu(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int64)


def _runs(starts: list[int], lengths: tuple[int, ...]) -> torch.Tensor:
    """The rows start, start + 1, ... of each run, run after run (no Python loop over rows)."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.tensor(starts, dtype=torch.int64) - torch.cumsum(lengths_t, 0) + lengths_t
    return torch.arange(int(lengths_t.sum())) + torch.repeat_interleave(offsets, lengths_t)


def _to_device(parts: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The int64 tensors `parts` on `device` through one buffer: a single pinned, non-blocking copy on CUDA."""
    if device.type == "cpu":
        return parts
    moved = to_device(torch.cat([p.reshape(-1) for p in parts.values()]), device)
    out, start = {}, 0
    for name, p in parts.items():
        out[name] = moved[start:start + p.numel()]
        start += p.numel()
    return out
