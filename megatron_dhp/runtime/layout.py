"""Where every token of a microbatch lives inside its group: zigzag shards as one THD tensor per rank.

Pure index math (no process group), shared by dispatch (which rows to send where), attention (which keys a
query may see) and the step (position ids, cu_seqlens). A sample of length L on a group of d > 1 ranks is
padded to a multiple of 2d and cut into 2d chunks of c tokens; group rank r keeps chunks r and 2d-1-r, so
every rank gets the same number of tokens and a balanced share of the causal work (Megatron's and
TransformerEngine's THD context-parallel convention, which lets their RoPE and attention read the same
layout). Padding sits at the end of each sample: under the causal mask no real query can see it, and the
loss mask drops it. A group of one rank keeps the sample whole and unpadded.
`microbatches_of` lays out every microbatch a domain position runs under a plan; dispatch (tokens) and
vision (image rows) both route by it.

*Uneven shards*: a plan group may carry `shares` (`plan.shares`), and rank r then holds a front chunk of c_r
tokens and its mirror from the back, c_r as `plan.shares.shard_chunks` cuts the sample (the one rule, which
the planner's memory and cost models ask too): front chunks in rank order from position 0, so rank r's starts
at o_r = c_0 + ... + c_(r-1) and its mirror covers [P - o_r - c_r, P - o_r) of the sample padded to
P = 2 sum c. Equal c_r is the zigzag above. Ranks then hold different numbers of rows (`rank_slots`), and
Megatron's and TransformerEngine's THD conventions (each rank's shard = padded / d) no longer hold: RoPE goes
by `positions` (`runtime.rope`) and TransformerEngine's attention is refused (`engine`).

Under sequence parallelism megatron-core splits every rank's THD rows over its T tensor-parallel ranks, so
each sample's shard must also divide by T (`seq_multiple`): samples are padded to a multiple of
lcm(2d, dT) (of T for d = 1), the same rule TransformerEngine's THD CP with SP follows; uneven chunks are
multiples of `plan.shares.chunk_unit`.

A layout may also carry `rows`: more padding at the end of its last sample, so that every rank of the group
holds that many rows (megatron-core's allgather MoE dispatcher needs every rank of an expert-parallel group to
hold as many rows as the others in a slot, see `slots.aligned_slot_rows`). It is padding like any other:
past the sample's end, unseen by real queries under the causal mask, never in the loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.plan.shares import shard_chunks


def shard_multiple(group_size: int, seq_multiple: int = 1) -> int:
    """Samples are padded to a multiple of this: 2d gives every rank two equal chunks (d = 1 needs none),
    and each rank's shard, padded / d, must divide by `seq_multiple` (the TP size under sequence parallelism)."""
    return math.lcm(1 if group_size == 1 else 2 * group_size, group_size * seq_multiple)


def padded_length(length: int, group_size: int, seq_multiple: int = 1) -> int:
    """The sample length rounded up to `shard_multiple(group_size, seq_multiple)`."""
    m = shard_multiple(group_size, seq_multiple)
    return -(-length // m) * m


def row_multiple(group_size: int, seq_multiple: int = 1) -> int:
    """A rank's shard of a sample grows in steps of this many rows (`shard_multiple` / d): two chunks of whole
    `plan.shares.chunk_unit`s, even or uneven."""
    return shard_multiple(group_size, seq_multiple) // group_size


def zigzag_positions(length: int, group_size: int, rank: int, seq_multiple: int = 1) -> torch.Tensor:
    """Positions of the padded sample that group rank `rank` holds, in its local order (even shards).

    Chunk `rank` then chunk `2d-1-rank`; positions >= `length` are padding. The position of a real token is
    also its index in the sample, so this doubles as the gather index for dispatch.
    """
    if not 0 <= rank < group_size:
        raise ValueError(f"rank {rank} is outside a group of {group_size}")
    padded = padded_length(length, group_size, seq_multiple)
    return shard_positions(padded, [padded // (2 * group_size)] * group_size, rank)


def shard_positions(padded: int, chunks: Sequence[int], rank: int) -> torch.Tensor:
    """Positions of a sample padded to `padded` that group rank `rank` holds when the ranks' chunks are `chunks`:
    its front chunk from o = sum(chunks[:rank]), then its mirror [padded - o - c, padded - o). A group of one
    holds the sample whole."""
    if len(chunks) == 1:
        return torch.arange(padded, dtype=torch.int64)
    c, o = chunks[rank], sum(chunks[:rank])
    front = torch.arange(o, o + c, dtype=torch.int64)
    return torch.cat((front, torch.arange(padded - o - c, padded - o, dtype=torch.int64)))


@dataclass(frozen=True)
class MicrobatchLayout:
    """The THD layout of one microbatch on one rank of its group.

    Local slots are ordered sample by sample (microbatch order), each sample's shard in zigzag order: its
    front chunk, then its back chunk. Under even shards every rank of the group holds `padded_length / d`
    slots per sample, so all ranks' layouts have equal length; under uneven `shares` each rank its own
    (`rank_slots`).
    """

    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    """True token counts of the samples, in microbatch order."""
    group_size: int
    rank: int
    """This rank's index in the group: its place among the group's sorted domain positions."""
    seq_multiple: int = 1
    """Each sample's shard divides by this: the tensor-parallel size under sequence parallelism, else 1."""
    shares: tuple[int, ...] = ()
    """Each group rank's part of every sample, in group-rank order (`PlanGroup.sorted_shares`); empty: even."""
    rows: int | None = None
    """Rows every rank of the group holds, the last sample padded further to reach them (`with_rows`); None:
    what the samples need."""

    def __post_init__(self) -> None:
        assert len(self.sample_ids) == len(self.lengths) > 0, "a microbatch holds at least one sample"
        # no empty sequence reaches attention: TransformerEngine's fused THD RoPE slows ~10x on them (TE #2599)
        assert min(self.lengths) >= 1, f"a microbatch's samples hold at least one token, got {self.lengths}"
        assert 0 <= self.rank < self.group_size, f"rank {self.rank} outside a group of {self.group_size}"
        assert len(self.shares) in (0, self.group_size) and all(w >= 1 for w in self.shares), (
            f"shares {self.shares} for a group of {self.group_size}")
        if self.rows is not None:
            extra = [self.rows - n for n in self._needed_slots]
            assert all(e >= 0 and e % self.row_multiple == 0 for e in extra), (
                f"{self.rows} rows are not the {self._needed_slots} rows the ranks need plus multiples of "
                f"{self.row_multiple}")

    @property
    def row_multiple(self) -> int:
        """`layout.row_multiple` of this group: the steps in which `num_slots` can grow."""
        return row_multiple(self.group_size, self.seq_multiple)

    @property
    def uneven(self) -> bool:
        """Whether the group's ranks hold different parts of each sample (`shares`)."""
        return bool(self.shares)

    def with_rows(self, rows: int) -> MicrobatchLayout:
        """This layout with its last sample padded further so each rank holds `rows` slots."""
        return replace(self, rows=rows)

    @cached_property
    def _needed(self) -> tuple[tuple[int, ...], ...]:
        """Rows of each sample on each group rank before `rows` pads the last one."""
        d, t = self.group_size, self.seq_multiple
        if not self.uneven:
            return tuple((padded_length(n, d, t) // d,) * d for n in self.lengths)
        return tuple(tuple(2 * c for c in shard_chunks(n, self.shares, t)) for n in self.lengths)

    @cached_property
    def _needed_slots(self) -> tuple[int, ...]:
        return tuple(map(sum, zip(*self._needed)))

    @cached_property
    def shards(self) -> tuple[tuple[int, ...], ...]:
        """Rows of each sample (microbatch order) on each group rank: two chunks of half as many (d > 1)."""
        if self.rows is None:
            return self._needed
        last = tuple(n + self.rows - s for n, s in zip(self._needed[-1], self._needed_slots))
        return (*self._needed[:-1], last)

    @cached_property
    def padded_lengths(self) -> tuple[int, ...]:
        """Sample lengths with their padding: rounded up to `shard_multiple` under even shards (unchanged for
        d = 1 without sequence parallelism), to 2 sum c under uneven ones, the last one up to `rows`."""
        return tuple(map(sum, self.shards))

    @property
    def padded(self) -> bool:
        """Whether any sample carries padding (TransformerEngine's `pad_between_seqs`)."""
        return self.padded_lengths != self.lengths

    def local_lengths_of(self, rank: int) -> tuple[int, ...]:
        """Slots per sample on group rank `rank`."""
        return tuple(s[rank] for s in self.shards)

    @cached_property
    def local_lengths(self) -> tuple[int, ...]:
        """Slots per sample on this rank."""
        return self.local_lengths_of(self.rank)

    @cached_property
    def rank_slots(self) -> tuple[int, ...]:
        """Local THD length of every group rank (equal under even shares)."""
        return tuple(map(sum, zip(*self.shards)))

    @property
    def num_slots(self) -> int:
        """Local THD length of this rank."""
        return self.rank_slots[self.rank]

    @property
    def max_seqlen(self) -> int:
        """Longest padded sample: what Megatron sizes its RoPE table by."""
        return max(self.padded_lengths)

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """Cumulative true sample lengths (TransformerEngine's `cu_seqlens` for THD context parallelism)."""
        return _cumsum(self.lengths)

    @cached_property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """Cumulative padded lengths: under even shards Megatron's THD RoPE divides them by d to find each local
        shard (under uneven ones RoPE reads `positions`, `runtime.rope`)."""
        return _cumsum(self.padded_lengths)

    @cached_property
    def local_cu_seqlens(self) -> torch.Tensor:
        """Cumulative local shard lengths: where each sample's shard starts in this rank's THD tensor."""
        return _cumsum(self.local_lengths)

    def chunks(self, index: int) -> tuple[int, ...]:
        """Each group rank's chunk length of sample `index`: its shard is two of them (a group of one holds the
        sample whole, one 'chunk')."""
        return tuple(n // 2 for n in self.shards[index]) if self.group_size > 1 else self.shards[index]

    def fronts(self, rank: int | None = None) -> tuple[int, ...]:
        """The first position of `rank`'s front chunk in each sample (default: this rank): o_r."""
        r = self.rank if rank is None else rank
        return tuple(sum(self.chunks(i)[:r]) for i in range(len(self.lengths)))

    def runs(self, rank: int | None = None) -> tuple[tuple[int, int], ...]:
        """(first position, rows) of each run of consecutive positions `rank` holds (default: this rank), in
        local order: its front chunk and its mirror of each sample (a group of one: each sample whole)."""
        r = self.rank if rank is None else rank
        out: list[tuple[int, int]] = []
        for i, (o, padded) in enumerate(zip(self.fronts(r), self.padded_lengths)):
            c = self.chunks(i)[r]
            out += [(o, c), (padded - o - c, c)] if self.group_size > 1 else [(0, c)]
        return tuple(out)

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """True position (index within its sample) of every local slot of `rank` (default: this rank)."""
        return torch.cat([self.sample_positions(i, rank) for i in range(len(self.lengths))])

    def sample_positions(self, index: int, rank: int | None = None) -> torch.Tensor:
        """Positions of sample `index` (in microbatch order) that `rank` holds (default: this rank)."""
        return shard_positions(self.padded_lengths[index], self.chunks(index), self.rank if rank is None else rank)

    @cached_property
    def local_positions(self) -> torch.Tensor:
        """`positions()` of this rank, computed once (attention reads it in every layer)."""
        return self.positions()

    def segments_of(self, rank: int) -> torch.Tensor:
        """Index within the microbatch of the sample each of `rank`'s slots belongs to."""
        counts = torch.tensor(self.local_lengths_of(rank), dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(len(self.lengths), dtype=torch.int64), counts)

    @cached_property
    def segments(self) -> torch.Tensor:
        """Index within the microbatch of the sample each local slot belongs to."""
        return self.segments_of(self.rank)

    def real(self, rank: int | None = None) -> torch.Tensor:
        """Which local slots of `rank` (default: this rank) hold real tokens rather than padding."""
        r = self.rank if rank is None else rank
        limit = torch.repeat_interleave(
            torch.tensor(self.lengths, dtype=torch.int64), torch.tensor(self.local_lengths_of(r), dtype=torch.int64)
        )
        return self.positions(r) < limit


def _cumsum(values: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(len(values) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(values, dtype=torch.int64), 0).to(torch.int32)
    return out


SlotRows = tuple[tuple[int, ...], ...]
"""Local rows of the k-th slot of each phase, `rows[phase][k]`, the same on every rank of the domain."""


def microbatches_of(plan: Plan, position: int, lengths: dict[int, int], seq_multiple: int,
                     slot_rows: SlotRows | None) -> list[tuple[MicrobatchLayout, tuple[int, ...], int]]:
    """(layout, sorted group ranks, phase) of every microbatch `position` runs, in execution order."""
    out = []
    for group in plan.groups_of_rank(position):
        ranks = tuple(sorted(group.ranks))
        for k in range(len(group.microbatches)):
            out.append((group_layout(group, k, ranks.index(position), lengths, seq_multiple, slot_rows), ranks,
                        group.phase))
    return out


def group_layout(group: PlanGroup, k: int, rank: int, lengths: dict[int, int], seq_multiple: int,
                 slot_rows: SlotRows | None) -> MicrobatchLayout:
    """The layout of `group`'s k-th microbatch on its `rank`-th member (in sorted order)."""
    mb = group.microbatches[k]
    layout = MicrobatchLayout(mb, tuple(lengths[s] for s in mb), group.size, rank, seq_multiple, group.sorted_shares)
    if slot_rows is not None:  # a rank's k-th microbatch of a phase is its k-th slot of it
        layout = layout.with_rows(slot_rows[group.phase][k])
    return layout
