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
class Runs:
    """This rank's rows as runs of consecutive positions (a group of d > 1: chunk r, then chunk 2d-1-r, of each
    sample; of one rank: each sample whole), each seeing its sample's first `first + rows` keys in position order (bottom-right causal): the
    all-gather's queries and keys."""

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
    halves: Spans | None
    """One zigzag chunk per sample (groups of d > 1): the rows of a ring step's front keys or back queries."""
    cu_seqlens: torch.Tensor
    """int32: cumulative true sample lengths (`PackedSeqParams.cu_seqlens_q`; `natural.cu` is the padded one)."""
    positions: torch.Tensor
    """int64 [t]: the true position of each local row (RoPE reads it too)."""
    segments: torch.Tensor
    """int64 [t]: the sample (index in the microbatch) of each local row."""
    front_rows: torch.Tensor | None
    """int64: the local rows of each sample's front chunk, sample by sample (d > 1)."""
    back_rows: torch.Tensor | None
    """int64: the local rows of each sample's back chunk (d > 1)."""
    runs: Runs
    """This rank's runs of consecutive positions and the keys each sees."""
    zigzag: DeviceZigzag
    """Every group rank's shards <-> natural order, its index tables on the device."""
    cache: dict[str, Any] = field(default_factory=dict)
    """What a backend derives from the above, once per microbatch, with device operations only."""

    @property
    def device(self) -> torch.device:  # noqa: D102
        return self.positions.device

    def ring_block(self, step: int) -> str:
        """The kind of ring step `step`: the block of group rank r - step (`RING_BLOCKS`)."""
        source = (self.layout.rank - step) % self.layout.group_size
        if source == self.layout.rank:
            return DIAGONAL
        return FRONT_KEYS if source < self.layout.rank else BACK_QUERIES

    @classmethod
    def build(cls, layout: MicrobatchLayout, device: torch.device | str = "cpu") -> AttentionMeta:
        """The metadata of `layout` on `device`: computed on the host, moved in one non-blocking copy."""
        device = torch.device(device)
        d = layout.group_size
        local_starts, natural_starts = _starts(layout.local_lengths), _starts(layout.padded_lengths)
        parts: dict[str, torch.Tensor] = {  # the layout's own cumulative lengths (int32), in the int64 buffer
            "cu_seqlens": layout.cu_seqlens.long(),
            "local": layout.local_cu_seqlens.long(),
            "natural": layout.cu_seqlens_padded.long(),
            "positions": layout.local_positions,
            "segments": layout.segments,
        }
        halves = tuple(n // 2 for n in layout.local_lengths)
        if d > 1:  # two runs per sample, chunk r then chunk 2d-1-r
            r = layout.rank
            run_rows = tuple(c for c in halves for _ in range(2))
            firsts = tuple(f for c in halves for f in (r * c, (2 * d - 1 - r) * c))
            key_starts = tuple(start for start in natural_starts for _ in range(2))
            parts["halves"] = _cu(halves)
            parts["front_rows"] = _runs(local_starts, halves)
            parts["back_rows"] = _runs([a + c for a, c in zip(local_starts, halves)], halves)
        else:  # each sample whole
            run_rows, firsts, key_starts = layout.local_lengths, (0,) * len(halves), tuple(natural_starts)
        seen = tuple(f + n for f, n in zip(firsts, run_rows))
        parts["run_rows"], parts["run_keys"] = _cu(run_rows), _cu(seen)
        parts["key_starts"] = torch.tensor(key_starts, dtype=torch.int64)
        moved = _to_device(parts, device)
        return cls(
            layout=layout,
            local=Spans(tuple(local_starts), layout.local_lengths, moved["local"].int()),
            natural=Spans(tuple(natural_starts), layout.padded_lengths, moved["natural"].int()),
            halves=Spans(tuple(_starts(halves)), halves, moved["halves"].int()) if d > 1 else None,
            cu_seqlens=moved["cu_seqlens"].int(),
            positions=moved["positions"],
            segments=moved["segments"],
            front_rows=moved.get("front_rows"),
            back_rows=moved.get("back_rows"),
            runs=Runs(
                queries=Spans(tuple(_starts(run_rows)), run_rows, moved["run_rows"].int()),
                keys=Spans(tuple(_starts(seen)), seen, moved["run_keys"].int()),
                firsts=firsts, key_starts=key_starts, key_starts_on_device=moved["key_starts"],
            ),
            zigzag=zigzag_on(layout.cu_seqlens_padded, d, None, device),
        )

    def shard_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(index within its sample's shard, the sample's zigzag chunk length) of each local row, on the device
        (d > 1, cached): a row is in the front chunk when its index is below the chunk length."""
        if "shard_rows" not in self.cache:
            index = torch.arange(self.positions.numel(), device=self.device) - self.local.cu[self.segments]
            self.cache["shard_rows"] = (index, (self.halves.cu[1:] - self.halves.cu[:-1])[self.segments])
        return self.cache["shard_rows"]

    def group_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, samples) of every group rank's rows, rank-major (an all-gather's order), derived on the
        device from this rank's (cached): rank r' holds chunks r' and 2d-1-r' of each sample."""
        if "group_rows" not in self.cache:
            d, t = self.layout.group_size, self.positions.numel()
            segments = self.segments.repeat(d)
            if d == 1:
                self.cache["group_rows"] = (self.positions, segments)
            else:
                ranks = torch.arange(d, device=self.device).repeat_interleave(t)
                index, chunk = self.shard_rows()
                offset, back = (index % chunk).repeat(d), (index >= chunk).repeat(d)
                which = torch.where(back, 2 * d - 1 - ranks, ranks)
                self.cache["group_rows"] = (which * chunk.repeat(d) + offset, segments)
        return self.cache["group_rows"]


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
