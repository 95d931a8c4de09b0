"""One planning problem as flat numpy arrays, with the per-group-size time tables the search reuses."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.family import GroupFamily
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.plan.shares import Pace, blend, blended_pace
from megatron_dhp.workload.sample import Batch


@dataclass
class Instance:
    """A batch under a cost model: ids, tokens, work, memory footprint and minimum degree of every sample."""

    model: CostModel
    ids: np.ndarray
    tokens: np.ndarray
    work: np.ndarray
    footprint: Footprint
    """Each sample's memory at the instance's cap (encoder activations included: `plan.memory`)."""
    min_degree: np.ndarray
    cap: int
    """Per-rank tokens one microbatch may hold: M, or M // P under pipeline parallelism (before `global`'s
    encoder share, which `footprint.cap` takes off)."""
    family: GroupFamily | None = None
    """The groups the plan may use (None: any contiguous window)."""
    _times: dict[tuple[int, bool, float | Pace], np.ndarray] = field(default_factory=dict, repr=False)
    _order: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)
    memo: dict = field(default_factory=dict, repr=False)
    """What the search derives once per instance and reuses across drafts (`layout.Windows`)."""

    @classmethod
    def from_batch(cls, batch: Batch, model: CostModel, cap: int | None = None,
                   family: GroupFamily | None = None) -> Instance:
        """Flatten the batch; every array is in batch order. `cap` (default M) bounds each microbatch."""
        cap = cap or model.domain.max_tokens_per_rank
        footprint = replace(model.memory_rule(), cap=cap).footprint(batch.samples, model.domain.world_size)
        return cls(
            model=model,
            ids=np.array(batch.ids, dtype=np.int64),
            tokens=batch.lengths,
            work=model.sample_work(batch.samples),
            footprint=footprint,
            min_degree=np.maximum(1, footprint.min_degree()),
            cap=cap,
            family=family,
        )

    @property
    def num_ranks(self) -> int:
        """N, the ranks of the dynamic domain."""
        return self.model.domain.world_size

    @property
    def sizes(self) -> np.ndarray:
        """Group sizes a sample may get: the family's, or every size 1..N."""
        return np.array(self.family.sizes) if self.family else np.arange(1, self.num_ranks + 1)

    @functools.cached_property
    def loads(self) -> tuple[list[int], list[int]]:
        """Each sample's `footprint` shared and held parts as Python ints: the search asks a sample's load per
        group thousands of times, and numpy on scalars costs more than the arithmetic."""
        return self.footprint.shared.tolist(), self.footprint.held.tolist()

    def load(self, item: int, size: int) -> int:
        """Tokens sample `item` takes of a microbatch's room of size x `footprint.cap` on `size` ranks
        (`Footprint.load`)."""
        shared, held = self.loads
        return shared[item] + size * held[item]

    @property
    def nominal(self) -> bool:
        """Whether every rank runs at speed 1 (the search then prices every group as it always has)."""
        return self.model.domain.nominal

    @property
    def speeds(self) -> np.ndarray:
        """Every rank's speed."""
        return self.model.domain.speeds

    def speed(self, first: int, size: int) -> float:
        """The speed of the slowest of ranks [first, first + size): what a microbatch's fixed cost runs at."""
        return self.model.group_speed(range(first, first + size))

    def overhead(self, size: int, speed: float | Pace = 1.0) -> float:
        """The fixed cost of one microbatch on a group of `size` ranks at `speed` (m, plus any multi-rank latency),
        at the slowest member's speed."""
        return self.model.microbatch_overhead(size, speed.slowest if isinstance(speed, Pace) else speed)

    def times(self, size: int, intra: bool, speed: float | Pace = 1.0) -> np.ndarray:
        """t(L, size) of every sample on a group of `size` ranks at `speed` (or `Pace`), cached per (size,
        placement, speed)."""
        key = (size, intra, speed)
        if key not in self._times:
            pace = {} if not isinstance(speed, Pace) else {"slowest": speed.slowest, "comm_scale": speed.comm_scale}
            self._times[key] = self.model.sample_time(self.tokens, self.work, size, intra,
                                                      speed.speed if pace else speed, **pace)
        return self._times[key]

    @functools.cached_property
    def share_limit(self) -> np.ndarray:
        """`Footprint.largest_parts`, once per solve (uneven shards give the fastest rank more than 1 / d,
        `plan.shares.blend`)."""
        return self.footprint.largest_parts()

    def wide_seconds(self, items: np.ndarray, size: np.ndarray, intra: np.ndarray, speed_sum: np.ndarray | float,
                     slowest: np.ndarray | float, fastest: np.ndarray | float,
                     limit: np.ndarray | None = None) -> np.ndarray:
        """(items, windows): each sample's seconds alone on each window of `size` ranks (placement `intra`,
        sum, slowest and fastest of its ranks' speeds). A window of mixed speeds runs with shares in proportion
        to them, mixed toward even as far as the sample's memory needs (`plan.shares.blend`; or as far as
        `limit`, each item's largest part, asks), when the model allows uneven shards and that is faster than
        even shards (it is not where communication binds: the largest share's block sets every step's); else
        at its slowest rank's speed."""
        tokens, work = self.tokens[items][:, None], self.work[items][:, None]  # (an index array keeps
        if self.nominal:                                                          # `SampleWork`'s fixed part)
            return self.model.sample_time(tokens, work, size[None, :], intra[None, :], 1.0)
        mixed = np.asarray(fastest > slowest)
        if not (self.model.uneven_shards and mixed.any()):
            return self.model.sample_time(tokens, work, size[None, :], intra[None, :], np.asarray(slowest)[None, :])
        limit = self.share_limit[items] if limit is None else limit
        alpha = blend(limit[:, None], size[None, :], (fastest / speed_sum)[None, :])
        speed, comm_scale = blended_pace(alpha, size[None, :], speed_sum[None, :], slowest[None, :], fastest[None, :])
        even = self.model.sample_time(tokens, work, size[None, :], intra[None, :], np.asarray(slowest)[None, :])
        return np.minimum(even, self.model.sample_time(tokens, work, size[None, :], intra[None, :],
                                                       np.where(mixed[None, :], speed, slowest[None, :]),
                                                       slowest=slowest[None, :],
                                                       comm_scale=np.where(mixed[None, :], comm_scale, 1.0)))

    def window_seconds(self, item: int, first: int, size: int) -> float:
        """`wide_seconds` of one sample on ranks [first, first + size)."""
        return float(self._on_window(np.array([item]), first, size)[0])

    def shared_seconds(self, microbatches: Sequence[Sequence[int]], first: int, size: int) -> float:
        """The seconds of a group's microbatches' samples on ranks [first, first + size) under the one split the
        plan gives the group (`plan_groups`: as even as its fullest microbatch needs, `Footprint.fitting_shares`),
        without the microbatches' overheads."""
        items = np.fromiter((i for mb in microbatches for i in mb), dtype=np.int64)
        limit = min(self.footprint.largest_part(mb) for mb in microbatches)
        return float(self._on_window(items, first, size, np.full(len(items), limit)).sum())

    def _on_window(self, items: np.ndarray, first: int, size: int, limit: np.ndarray | None = None) -> np.ndarray:
        s, intra = self.speeds[first : first + size], self.model.is_intra(range(first, first + size))
        return self.wide_seconds(items, np.array([size]), np.array([intra]), np.array([s.sum()]), np.array([s.min()]),
                                 np.array([s.max()]), limit)[:, 0]

    def plan_groups(self, drafts: Sequence[tuple[tuple[int, ...], Sequence[Sequence[int]], int]]) -> list[PlanGroup]:
        """The `PlanGroup`s of draft groups (ranks, `microbatches` of instance indices, phase), each with the
        shares its speeds ask for, as even as its microbatches' memory needs (`plan.shares.shares_within`),
        where they make it faster than even shares (`_faster_with_shares`)."""
        shares = [self._speed_shares(ranks, mbs) for ranks, mbs, _ in drafts]
        mixed = [k for k, w in enumerate(shares) if w]
        if mixed:
            faster = self._faster_with_shares([drafts[k][:2] for k in mixed], [shares[k] for k in mixed])
            for k, keep in zip(mixed, faster):
                shares[k] = shares[k] if keep else ()
        id_of = self.id_list.__getitem__  # ids and ranks are Python ints, shares normalized: no copies
        return [PlanGroup.of_normal_form(tuple(ranks), tuple([tuple(map(id_of, mb)) for mb in mbs]), int(phase), w)
                for (ranks, mbs, phase), w in zip(drafts, shares)]

    def _speed_shares(self, ranks: tuple[int, ...], microbatches: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """A group's shares in proportion to its speeds, fitted to its microbatches' memory; () where even."""
        if self.nominal or not len(microbatches) or len(ranks) < 2:
            return ()
        speeds = self.speeds[list(ranks)]
        if not speeds.max() > speeds.min():
            return ()
        shares = self.model.group_shares(ranks)
        return self.footprint.fitting_shares(shares, microbatches, len(ranks)) if shares else ()

    def _faster_with_shares(self, groups: Sequence[tuple[tuple[int, ...], Sequence[Sequence[int]]]],
                            shares: Sequence[tuple[int, ...]]) -> list[bool]:
        """Per group, whether its microbatches (instance indices) take less time with its `shares` than with even
        shares: their samples at the group's `Pace` plus each microbatch's overhead, every group's samples priced
        in one `sample_time` call per split (groups of mixed speeds are a hundred and more at 1,024 ranks)."""
        items = [np.fromiter((i for mb in mbs for i in mb), dtype=np.int64) for _, mbs in groups]
        counts = [len(k) for k in items]
        flat = np.concatenate(items)
        sizes = np.repeat([len(ranks) for ranks, _ in groups], counts)
        intra = np.repeat([self.model.is_intra(ranks) for ranks, _ in groups], counts)
        paces = [(self.model.group_pace(ranks, w), self.model.group_pace(ranks, ())) for (ranks, _), w in zip(groups, shares)]
        tokens, work, ends = self.tokens[flat], self.work[flat], np.cumsum(counts)
        seconds = []
        for k in range(2):  # with the shares, then even
            speed, slowest, scale = (np.repeat([getattr(p[k], f) for p in paces], counts)
                                     for f in ("speed", "slowest", "comm_scale"))
            t = self.model.sample_time(tokens, work, sizes, intra, speed, slowest=slowest, comm_scale=scale)
            seconds.append([float(t[e - c : e].sum()) + len(mbs) * self.model.microbatch_overhead(len(ranks), p[k].slowest)
                            for e, c, (ranks, mbs), p in zip(ends.tolist(), counts, groups, paces)])
        return [with_shares < even for with_shares, even in zip(*seconds)]

    @functools.cached_property
    def id_list(self) -> list[int]:
        """`ids` as Python ints (a plan's thousands of microbatch entries read them one by one)."""
        return self.ids.tolist()

    @functools.cached_property
    def position(self) -> dict[int, int]:
        """Each sample id's index in the instance (a planned layout's microbatches hold ids)."""
        return dict(zip(self.id_list, range(len(self.id_list))))

    def layout_times(self, groups: Sequence[PlanGroup]) -> list[tuple[float, ...]]:
        """Seconds of each microbatch (overhead plus its samples) of every planned group, from the tables, in
        one pass over all their samples (a planner prices whole layouts at a time)."""
        if not len(self._order):
            self._order = np.argsort(self.ids, kind="stable")
        keys = [(g.size, self.model.is_intra(g.ranks),
                 self.model.group_pace(g.ranks, g.shares) if g.shares else self.model.group_speed(g.ranks))
                for g in groups]
        unique = list(dict.fromkeys(keys))
        table = np.stack([self.times(*k) for k in unique]) if unique else np.zeros((0, len(self.ids)))
        overhead = np.array([self.overhead(size, speed) for size, _, speed in unique])
        key_of = {k: n for n, k in enumerate(unique)}
        mb_len = np.array([len(mb) for g in groups for mb in g.microbatches], dtype=np.int64)
        mb_key = np.repeat([key_of[k] for k in keys], [len(g.microbatches) for g in groups]).astype(np.int64)
        ids = np.fromiter((i for g in groups for mb in g.microbatches for i in mb), dtype=np.int64, count=int(mb_len.sum()))
        pos = self._order[np.searchsorted(self.ids, ids, sorter=self._order)]
        t = table[np.repeat(mb_key, mb_len), pos]
        mb_s = (overhead[mb_key] + np.add.reduceat(t, np.cumsum(mb_len) - mb_len)).tolist() if len(t) else []
        out, k = [], 0
        for g in groups:
            out.append(tuple(mb_s[k : k + len(g.microbatches)]))
            k += len(g.microbatches)
        return out
