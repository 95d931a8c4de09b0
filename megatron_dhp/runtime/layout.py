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

Under sequence parallelism megatron-core splits every rank's THD rows over its T tensor-parallel ranks, so
each sample's shard must also divide by T (`seq_multiple`): samples are padded to a multiple of
lcm(2d, dT) (of T for d = 1), the same rule TransformerEngine's THD CP with SP follows.

A layout may also carry `extra_rows`: more padding at the end of its last sample, so that a rank holds a
given number of rows (megatron-core's allgather MoE dispatcher needs every rank of an expert-parallel group
to hold as many rows as the others in a slot, see `slots.aligned_slot_rows`). It is padding like any other:
past the sample's end, unseen by real queries under the causal mask, never in the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from megatron_dhp.plan.plan import Plan, PlanGroup


def shard_multiple(group_size: int, seq_multiple: int = 1) -> int:
    """Samples are padded to a multiple of this: 2d gives every rank two equal chunks (d = 1 needs none),
    and each rank's shard, padded / d, must divide by `seq_multiple` (the TP size under sequence parallelism)."""
    return math.lcm(1 if group_size == 1 else 2 * group_size, group_size * seq_multiple)


def padded_length(length: int, group_size: int, seq_multiple: int = 1) -> int:
    """The sample length rounded up to `shard_multiple(group_size, seq_multiple)`."""
    m = shard_multiple(group_size, seq_multiple)
    return -(-length // m) * m


def row_multiple(group_size: int, seq_multiple: int = 1) -> int:
    """A rank's shard of a sample grows in steps of this many rows (`shard_multiple` / d)."""
    return shard_multiple(group_size, seq_multiple) // group_size


def zigzag_positions(length: int, group_size: int, rank: int, seq_multiple: int = 1) -> torch.Tensor:
    """Positions of the padded sample that group rank `rank` holds, in its local order.

    Chunk `rank` then chunk `2d-1-rank`; positions >= `length` are padding. The position of a real token is
    also its index in the sample, so this doubles as the gather index for dispatch.
    """
    return _zigzag(padded_length(length, group_size, seq_multiple), group_size, rank)


def _zigzag(padded: int, group_size: int, rank: int) -> torch.Tensor:
    """`zigzag_positions` of a sample padded to `padded` (a multiple of 2d for d > 1)."""
    if not 0 <= rank < group_size:
        raise ValueError(f"rank {rank} is outside a group of {group_size}")
    if group_size == 1:
        return torch.arange(padded, dtype=torch.int64)
    chunk = padded // (2 * group_size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.int64)
    mirror = 2 * group_size - 1 - rank
    second = torch.arange(mirror * chunk, (mirror + 1) * chunk, dtype=torch.int64)
    return torch.cat((first, second))


@dataclass(frozen=True)
class MicrobatchLayout:
    """The THD layout of one microbatch on one rank of its group.

    Local slots are ordered sample by sample (microbatch order), each sample's shard in zigzag order. Every
    rank of the group holds `padded_length / d` slots per sample, so all ranks' layouts have equal length.
    """

    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    """True token counts of the samples, in microbatch order."""
    group_size: int
    rank: int
    """This rank's index in the group: its place among the group's sorted domain positions."""
    seq_multiple: int = 1
    """Each sample's shard divides by this: the tensor-parallel size under sequence parallelism, else 1."""
    extra_rows: int = 0
    """Padding rows added to each rank's shard of the last sample (a multiple of `row_multiple`)."""

    def __post_init__(self) -> None:
        assert len(self.sample_ids) == len(self.lengths) > 0, "a microbatch holds at least one sample"
        # no empty sequence reaches attention: TransformerEngine's fused THD RoPE slows ~10x on them (TE #2599)
        assert min(self.lengths) >= 1, f"a microbatch's samples hold at least one token, got {self.lengths}"
        assert 0 <= self.rank < self.group_size, f"rank {self.rank} outside a group of {self.group_size}"
        assert self.extra_rows >= 0 and self.extra_rows % self.row_multiple == 0, (
            f"{self.extra_rows} extra rows are not a multiple of {self.row_multiple}")

    @property
    def row_multiple(self) -> int:
        """`layout.row_multiple` of this group: the steps in which `num_slots` can grow."""
        return row_multiple(self.group_size, self.seq_multiple)

    def with_rows(self, rows: int) -> MicrobatchLayout:
        """This layout with its last sample padded further so each rank holds `rows` slots."""
        return replace(self, extra_rows=self.extra_rows + rows - self.num_slots)

    @cached_property
    def padded_lengths(self) -> tuple[int, ...]:
        """Sample lengths rounded up to `shard_multiple` (unchanged for d = 1 without sequence parallelism),
        the last one plus `extra_rows` per rank."""
        padded = [padded_length(n, self.group_size, self.seq_multiple) for n in self.lengths]
        padded[-1] += self.extra_rows * self.group_size
        return tuple(padded)

    @property
    def padded(self) -> bool:
        """Whether any sample carries padding (TransformerEngine's `pad_between_seqs`)."""
        return self.padded_lengths != self.lengths

    @cached_property
    def local_lengths(self) -> tuple[int, ...]:
        """Slots per sample on each rank of the group."""
        return tuple(n // self.group_size for n in self.padded_lengths)

    @property
    def num_slots(self) -> int:
        """Local THD length (equal on every rank of the group)."""
        return sum(self.local_lengths)

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
        """Cumulative padded lengths: Megatron's THD RoPE divides them by d to find each local shard."""
        return _cumsum(self.padded_lengths)

    @cached_property
    def local_cu_seqlens(self) -> torch.Tensor:
        """Cumulative local shard lengths: where each sample's shard starts in this rank's THD tensor."""
        return _cumsum(self.local_lengths)

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """True position (index within its sample) of every local slot of `rank` (default: this rank)."""
        return torch.cat([self.sample_positions(i, rank) for i in range(len(self.lengths))])

    def sample_positions(self, index: int, rank: int | None = None) -> torch.Tensor:
        """Positions of sample `index` (in microbatch order) that `rank` holds (default: this rank)."""
        return _zigzag(self.padded_lengths[index], self.group_size, self.rank if rank is None else rank)

    @cached_property
    def local_positions(self) -> torch.Tensor:
        """`positions()` of this rank, computed once (attention reads it in every layer)."""
        return self.positions()

    @cached_property
    def segments(self) -> torch.Tensor:
        """Index within the microbatch of the sample each local slot belongs to (the same on every rank)."""
        counts = torch.tensor(self.local_lengths, dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(len(self.lengths), dtype=torch.int64), counts)

    def real(self, rank: int | None = None) -> torch.Tensor:
        """Which local slots of `rank` hold real tokens rather than padding."""
        limit = torch.repeat_interleave(
            torch.tensor(self.lengths, dtype=torch.int64), torch.tensor(self.local_lengths, dtype=torch.int64)
        )
        return self.positions(rank) < limit

    @cached_property
    def group_positions(self) -> torch.Tensor:
        """Positions of all the group's slots, rank-major: the order of an all-gather over the group."""
        return torch.cat([self.positions(r) for r in range(self.group_size)])

    @cached_property
    def group_segments(self) -> torch.Tensor:
        """Sample index of all the group's slots, rank-major."""
        return self.segments.repeat(self.group_size)


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
    layout = MicrobatchLayout(mb, tuple(lengths[s] for s in mb), group.size, rank, seq_multiple)
    if slot_rows is not None:  # a rank's k-th microbatch of a phase is its k-th slot of it
        layout = layout.with_rows(slot_rows[group.phase][k])
    return layout
