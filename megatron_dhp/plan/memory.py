"""The memory rule: what a microbatch puts on each rank of its group, the vision encoder's activations included.

An LLM token of a microbatch on d ranks holds 1 / d token of activations on each (its zigzag shard). An
encoder token holds w = `enc_memory_per_token` tokens' worth (its activations, kept until the encoder's
backward, in LLM tokens: about the encoder's hidden size x layers over the LLM's). Where the encoder runs
(`cost.encoder`) decides whose memory that is:

- `split`: the group shares the images, so a microbatch of samples S on d ranks puts sum_S (L + w P) / d on
  each rank;
- `replicate`: every rank of the group encodes all the group's images: sum_S L / d + w sum_S P on each;
- `global`: each rank encodes its share of the whole batch's items (longest first to the least loaded, as
  the runtime places them) before the first microbatch and keeps the activations until after the last, so
  w x the largest share sits on every rank for the whole step, and a microbatch adds sum_S L / d.

Per rank that must stay within the cap M. With w = 0 (the reference model's, docs/cost-model.md) only LLM tokens
count. Tokens are whole: each sample's encoder share is rounded up. More ranks never hold more per rank, so a
microbatch that fits d ranks fits any wider group.

Under the all-gather variant every rank of a group also keeps the group's keys and values for its backward:
g = `kv_memory_per_token` tokens' worth per token of the microbatch, on every rank whatever d is, so a microbatch
of samples S holds g sum_S L on each rank beside its shard (`ModelMemory` derives g from the model's shape). A
live job on a GPU counts it when some group gathers (`plan.comm.CommPolicy.gathers_kv`); the reference model's
g is 0.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.shares import shares_within
from megatron_dhp.workload.sample import Sample

MIB = 2**20

UNPLACEABLE = np.iinfo(np.int64).max // 4
"""The minimum degree of a sample whose encoder activations alone exceed a rank (replicate): no group holds it."""


def longest_first_makespan(sizes: Iterable[float], ranks: int) -> float:
    """The largest load when `sizes` go longest first to the least-loaded of `ranks` (LPT)."""
    sizes = sorted(sizes, reverse=True)
    if len(sizes) <= ranks:
        return float(sizes[0]) if sizes else 0.0
    loads = [0.0] * ranks
    for size in sizes:
        heapq.heapreplace(loads, loads[0] + size)
    return max(loads)


def longest_sample(cap: int, world_size: int, kv_memory_per_token: float = 0.0) -> int:
    """The longest text sample the whole domain holds at `cap` tokens per rank: N x cap, less what its gathered
    keys and values take on every rank (L + N ceil(g L) <= N cap, exact in integers)."""
    def fits(length: int) -> bool:
        return length + world_size * math.ceil(kv_memory_per_token * length) <= world_size * cap

    length = int(world_size * cap / (1 + world_size * kv_memory_per_token))
    while length > 0 and not fits(length):
        length -= 1
    while fits(length + 1):
        length += 1
    return length


def ranks_cap_for(length: int, world_size: int, kv_memory_per_token: float = 0.0) -> int:
    """The least per-rank cap at which the whole domain holds a text sample of `length` (`longest_sample`'s
    inverse): ceil(L / N) + ceil(g L)."""
    return -(-length // world_size) + math.ceil(kv_memory_per_token * length)


@dataclass(frozen=True)
class ModelMemory:
    """What one token of a microbatch keeps on a rank until its backward, in MB, from the model's shape: what a
    job needs to count its communicators and its gathered keys and values against the token cap unprofiled."""

    activation_mb: float
    """Its share of the activations of this rank's pipeline stage."""
    gathered_kv_mb: float
    """Its keys and values, kept on every rank of its group under the all-gather variant."""

    @classmethod
    def of_gpt(cls, *, hidden: int, ffn_hidden: int, layers: int, kv_channels: int, tensor_parallel: int = 1,
               pipeline_stages: int = 1, element_bytes: int = 2, full_recompute: bool = False) -> ModelMemory:
        """A GPT's: per layer (18 h + 4 f) bytes in 16 bits over the TP ranks (Korthikanti et al.'s count with
        flash attention and sequence parallelism, the one Megatron-LM's theoretical memory report makes), only the
        layer's input (2 h) under full recompute; its keys and values 2 x `kv_channels` (query groups x head
        size) values per layer (one layer's under full recompute). Over the stage's layers, L / P."""
        per_layer = 2 * hidden if full_recompute else 18 * hidden + 4 * ffn_hidden
        stage = layers / pipeline_stages
        scale = element_bytes / 2 / tensor_parallel / MIB
        return cls(per_layer * stage * scale, 2 * kv_channels * 2 * (1 if full_recompute else stage) * scale)

    @property
    def kv_memory_per_token(self) -> float:
        """g: a token's gathered keys and values in tokens of activations (`MemoryRule.kv_memory_per_token`)."""
        return self.gathered_kv_mb / self.activation_mb


@dataclass(frozen=True)
class Footprint:
    """Each sample's memory in tokens: a microbatch of samples S on d ranks holds
    sum_S shared / d + sum_S held per rank, which must stay <= `cap`."""

    shared: np.ndarray
    """Tokens the group's ranks divide: L (+ w P under split)."""
    held: np.ndarray
    """Tokens every rank of the group holds whole: g L (the gathered keys and values) plus w P under replicate."""
    cap: int
    """Tokens per rank a microbatch may use: M, less global's step-long encoder share."""

    def load(self, index: np.ndarray | int, degree: np.ndarray | int) -> np.ndarray:
        """What a sample takes of a microbatch's room of `degree` x cap tokens: shared + degree x held."""
        return self.shared[index] + np.asarray(degree, dtype=np.int64) * self.held[index]

    def linear(self, max_degree: int) -> np.ndarray:
        """Sizes that count memory the way planners of tokens do (a microbatch's sizes <= d x cap), safe on any
        group of at most `max_degree` ranks: shared + max_degree x held (exact where nothing is held)."""
        return self.shared + max_degree * self.held

    def min_degree(self) -> np.ndarray:
        """The fewest ranks that hold each sample alone: ceil(shared / (cap - held)), `UNPLACEABLE` where the
        held part alone fills a rank."""
        room = self.cap - self.held
        return np.where(room > 0, -(-self.shared // np.maximum(room, 1)), UNPLACEABLE)

    def per_rank(self, index: Sequence[int], degree: int, shares: Sequence[int] = ()) -> float:
        """Tokens on the fullest rank of a microbatch of these samples on `degree` ranks (with uneven `shares`
        (`plan.shares`), the rank of the largest share)."""
        index = np.asarray(index, dtype=np.int64)
        part = max(shares) / sum(shares) if len(shares) else 1.0 / degree
        return float(self.shared[index].sum()) * part + float(self.held[index].sum())

    def largest_part(self, index: Sequence[int]) -> float:
        """The most of a microbatch of these samples one rank may hold: (cap - held) / shared (an even share
        is 1 / d of it; uneven shares, `plan.shares`, give some rank more)."""
        shared, room = self._sums(index)
        return room / max(shared, 1)

    def largest_parts(self) -> np.ndarray:
        """`largest_part` of each sample alone in a microbatch, for all at once."""
        return (self.cap - self.held) / np.maximum(self.shared, 1)

    def fitting_shares(self, shares: Sequence[int], microbatches: Sequence[Sequence[int]],
                       degree: int) -> tuple[int, ...]:
        """`shares` mixed toward even as far as every microbatch (samples' indices) on `degree` ranks needs to
        stay within the cap on its rank of the largest share (`plan.shares.shares_within`)."""
        sums = [self._sums(mb) for mb in microbatches]  # once: the mix is bisected against them
        limit = min(room / max(shared, 1) for shared, room in sums)
        return shares_within(shares, limit, lambda w: all(_fits_part(shared, room, w, degree) for shared, room in sums))

    def _sums(self, index: Sequence[int]) -> tuple[int, int]:
        """(shared tokens, room per rank: cap - held) of a microbatch of these samples."""
        index = np.asarray(index, dtype=np.int64)
        return int(self.shared[index].sum()), self.cap - int(self.held[index].sum())

    def min_ranks(self, index: Sequence[int]) -> int:
        """The fewest ranks a microbatch of these samples fits (`UNPLACEABLE` if none)."""
        shared, room = self._sums(index)
        return -(-shared // room) if room > 0 else UNPLACEABLE

    def fits_each(self, microbatches: Sequence[Sequence[int]], degrees: Sequence[int],
                  shares: Sequence[Sequence[int]]) -> list[bool]:
        """`fits` of each microbatch (none empty) on its degree with its group's shares, the sums of all taken
        in one pass (a plan at 1,024 ranks holds thousands)."""
        lengths = np.fromiter(map(len, microbatches), dtype=np.int64, count=len(microbatches))
        index = np.fromiter((i for mb in microbatches for i in mb), dtype=np.int64, count=int(lengths.sum()))
        starts = np.cumsum(lengths) - lengths
        shared, held = ((np.add.reduceat(a[index], starts).tolist() if len(index) else []) for a in (self.shared, self.held))
        return [_fits_part(s, self.cap - h, w, d) for s, h, w, d in zip(shared, held, shares, degrees)]

    def fits(self, index: Sequence[int], degree: int, shares: Sequence[int] = ()) -> bool:
        """Whether a microbatch of these samples fits `degree` ranks (exact integer arithmetic); with uneven
        `shares`, whether it fits the rank of the largest share: shared max(w) / sum(w) + held <= cap."""
        return _fits_part(*self._sums(index), shares, degree)


def _fits_part(shared: int, room: int, shares: Sequence[int], degree: int) -> bool:
    """Whether the rank of the largest share (of `degree` even ones where `shares` is empty) holds its part of
    `shared` tokens within `room` (exact integers)."""
    return shared * max(shares) <= room * sum(shares) if len(shares) else shared <= room * degree


@dataclass(frozen=True)
class MemoryRule:
    """The per-rank token cap and how encoder activations count against it (see the module docstring)."""

    cap: int
    """M: tokens per rank."""
    enc_memory_per_token: float = 0.0
    """w: an encoder token's activations in LLM tokens."""
    placement: str = "split"
    """Where the encoder runs (a concrete placement of `cost.encoder`; `auto` counts as split until resolved)."""
    kv_memory_per_token: float = 0.0
    """g: a token's keys and values, gathered on every rank of its group, in tokens (0: not counted)."""

    def footprint(self, samples: Sequence[Sample], world_size: int) -> Footprint:
        """Every sample's `Footprint` on a domain of `world_size` ranks."""
        tokens = np.fromiter((s.tokens for s in samples), dtype=np.int64, count=len(samples))
        kv = np.ceil(self.kv_memory_per_token * tokens).astype(np.int64)  # every rank holds it whole
        w = self.enc_memory_per_token
        if not w:
            return Footprint(tokens, kv, self.cap)
        enc = np.array([math.ceil(w * sum(item.enc for item in s.images)) for s in samples], dtype=np.int64)
        if self.placement == "replicate":
            return Footprint(tokens, enc + kv, self.cap)
        if self.placement == "global":
            share = longest_first_makespan((item.enc for s in samples for item in s.images), world_size)
            return Footprint(tokens, kv, self.cap - math.ceil(w * share))
        return Footprint(tokens + enc, kv, self.cap)

    def check(self, samples: Sequence[Sample], world_size: int) -> Footprint:
        """The samples' `Footprint`, or `DhpError` naming the first sample no group of the domain can hold."""
        footprint = self.footprint(samples, world_size)
        need = footprint.min_degree()
        if not len(need) or need.max() <= world_size:
            return footprint
        i = int(np.argmax(need > world_size))
        s, w = samples[i], self.enc_memory_per_token
        if self.kv_memory_per_token and replace(self, kv_memory_per_token=0.0).footprint(
                samples[i:i + 1], world_size).min_degree()[0] <= world_size:
            raise DhpError(
                f"sample {s.id} ({s.tokens} tokens) fits no group of the domain's {world_size} ranks once each keeps "
                f"the group's keys and values for the backward, {int(footprint.held[i])} tokens' worth under the "
                f"all-gather variant (kv_memory_per_token {self.kv_memory_per_token:.4g}); use comm ring or p2p, "
                "which keep a shard only, or raise max_tokens_per_rank")
        fix = "use encoder_placement split, or lower enc_memory_per_token (e.g. with activation recompute)"
        if footprint.cap < 1:
            raise DhpError(
                f"under encoder_placement global every rank keeps its share of the batch's encoder activations "
                f"for the whole step, {self.cap - footprint.cap} tokens (enc_memory_per_token {w}), which fills the "
                f"cap of {self.cap} per rank; {fix}")
        if need[i] == UNPLACEABLE:
            raise DhpError(
                f"sample {s.id}'s images hold {int(footprint.held[i])} tokens of encoder activations "
                f"(enc_memory_per_token {w}) on every rank of its group under encoder_placement replicate, "
                f"which fills the cap of {footprint.cap} per rank; {fix}")
        grow = "raise --world-size or --max-tokens-per-rank, or lower enc_memory_per_token"
        if self.placement in ("replicate", "global"):  # its shared part is its LLM tokens; the rank holds more
            held = (f"{int(footprint.held[i])} tokens of its images' encoder activations on each rank"
                    if self.placement == "replicate" else
                    f"{self.cap - footprint.cap} tokens of global's encoder share on each rank all step")
            raise DhpError(
                f"sample {s.id} needs {int(need[i])} ranks for its {s.tokens} LLM tokens beside {held} "
                f"(enc_memory_per_token {w}), more than the domain's {world_size}; {grow}")
        raise DhpError(
            f"sample {s.id} holds {int(footprint.shared[i])} tokens of memory ({s.tokens} LLM tokens and its "
            f"images' encoder activations at enc_memory_per_token {w}), more than the domain's {world_size} ranks "
            f"of {footprint.cap}; {grow}")
