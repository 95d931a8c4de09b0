"""The group family: every multi-rank group a job may use, fixed at start-up, at most K per rank.

Every distinct rank group is an NCCL communicator (hundreds of MB, and a collective creation that stalls
every rank), so planners that invent contiguous windows of any size at any offset make a job run out of
memory or stall at scale. A `GroupFamily` is the fixed set the job creates once; planners plan only with it.

It is a pure function of (N = world_size, g = gpus_per_node, K = max_groups_per_rank), built by
`group_family`, and holds windows of contiguous domain positions:

- inside each node (the last node may be partial): every size s of the size ladder, every divisor of g
  (the dhp planner's cells) and the node itself. Divisors of g and powers of two tile the node at stride s
  (cell-aligned; megatron-core's aligned power-of-two blocks); any other s sits at both ends of each
  aligned power-of-two block of the next power of two B >= s, so the rest of a block that such a window
  leaves free is a window too. Where that block is the node (5 - 7 ranks at g = 8) one window starts the
  node, and the family also tiles the domain with s across node boundaries (windows at 0, s, 2s, ...):
  otherwise one such sample per node would leave the rest of each node idle while it runs (`replicate`'s
  6 - 7-rank videos).
- across node boundaries: every ladder size s with g < s < 2g tiling the domain, once from its first rank
  (windows at 0, s, 2s, ...) and once from its last, so that N / s such groups run side by side (two per
  rank at most, as many as windows at both ends of each node pair would hold, which let only one run per
  pair and leave batches of 9 - 11-rank videos, or WLB-LLM without overlap, waiting for them).
  Without any of these a sample that needs 9 - 15 ranks at g = 8 would get 16, a large share of its
  step's ranks idle on WLB-LLM at N = 64.
- across nodes: k whole nodes for every k >= 2 of the ladder, at node offsets that are multiples of k
  (aligned runs of nodes; megatron-core's power-of-two blocks above a node), and the whole domain.

The ladder with p steps per octave is 1..p and then 2^j (1 + i/p): consecutive sizes differ by at most a
factor 1 + 1/p. The builder takes the finest p of (8, 4, 2, 1) whose largest per-rank membership is <= K.
"Close" is then: for d < 2g the smallest family size >= d is at most d (1 + 1/p) (and at most 2g); for
d >= 2g it is at most min(N, g * ceil(ceil(d / g) * (1 + 1/p))): one ladder step up in whole nodes.

The default K = 32 (`DEFAULT_MAX_GROUPS_PER_RANK`) fits p = 8 (every size to 16 nodes) at N = 64, p = 4
(at most 25 % more ranks) at N = 256 and p = 2 (at most 50 %) at N = 1,024 and 16,384 with g = 8 (what
the family costs dhp's plans against unrestricted groups: docs/results.md, "Group family").
32 communicators per rank is about what megatron-core's hybrid CP plus Megatron's own ~20 groups hold,
a few GB at the reported few hundred MB each and lazily connected since NCCL 2.22. K = 0 means no family.

API for the runtime (the group pool creates the family at start-up, collectively, on every rank alike):

    family = group_family(world_size, gpus_per_node, max_groups_per_rank)
    for ranks in family.groups:   # sorted tuples of domain positions, in the one creation order
        ...                       # create the communicator of `ranks` in every domain
    family.contains(ranks)        # is this plan group (any order) one of them (a single rank always is)
    family.membership             # groups per domain position; family.max_membership <= K

and for planners: `sizes` (every size with a window, 1 included), `starts(size)`, `placements(size)`,
`ceil_size(d)` (the smallest size >= d), `largest_at(start, limit)` and `first_free(size, free)`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from megatron_dhp.errors import DhpError

DEFAULT_MAX_GROUPS_PER_RANK = 32
LADDER_STEPS = (8, 4, 2, 1)
"""Steps per octave the builder tries, finest first."""


def ladder(limit: int, steps: int) -> list[int]:
    """Sizes 1..limit of the ladder with `steps` per octave: 1..steps, then 2^j (1 + i / steps)."""
    sizes = set(range(1, min(limit, steps) + 1))
    base = 1
    while base < steps:
        base *= 2
    while base <= limit:
        sizes.update(s for s in range(base, 2 * base, base // steps) if s <= limit)
        base *= 2
    return sorted(sizes)


def _node_windows(node_size: int, gpus_per_node: int, sizes: list[int], tiled: bool) -> set[tuple[int, int]]:
    """(offset, size) windows of 2+ ranks inside a node of `node_size` ranks (see the module doc); `tiled`:
    the domain's tilings hold `straddling_sizes` beyond a full node's first window."""
    cells = {d for d in range(2, gpus_per_node + 1) if gpus_per_node % d == 0}
    out: set[tuple[int, int]] = set()
    for s in sorted(set(sizes) | cells | {node_size}):
        if not 2 <= s <= node_size:
            continue
        if s in cells or s & (s - 1) == 0 or s == node_size:
            out.update((o, s) for o in range(0, node_size - s + 1, s))
            continue
        block = 1 << (s - 1).bit_length()
        if block >= node_size:  # both ends, or only the start of a full node where the domain tiling holds the rest
            out.update({(0, s)} if tiled and node_size == gpus_per_node else {(0, s), (node_size - s, s)})
            continue
        for b in range(0, node_size - block + 1, block):
            out.update({(b, s), (b + block - s, s)})
    return out


def straddling_sizes(gpus_per_node: int, sizes: list[int]) -> list[int]:
    """Sizes of a node or less that fit it only once (over half a node, neither a divisor of g nor a power of
    two): the family also tiles the domain with them across node boundaries."""
    g = gpus_per_node
    return [s for s in sizes if 2 * s > g and s < g and g % s and s & (s - 1)]


def _windows(world_size: int, gpus_per_node: int, steps: int) -> np.ndarray:
    """Every (start, size) window of 2+ ranks of the family with this ladder, in creation order (by size,
    then start), as rows of an array (numpy: N = 16,384 has some 30,000)."""
    n, g = world_size, gpus_per_node
    full, last = divmod(n, g)
    intra = ladder(min(n, g), steps)
    parts = []
    for count, first, size in ((full, 0, g), (1 if last else 0, full * g, last)):
        pattern = np.array(sorted(_node_windows(size, g, intra, n > g)), dtype=np.int64).reshape(-1, 2)
        if count and len(pattern):
            offsets = first + g * np.arange(count, dtype=np.int64)
            starts = (offsets[:, None] + pattern[None, :, 0]).ravel()
            parts.append(np.stack([starts, np.tile(pattern[:, 1], count)], axis=1))
    nodes = full + (1 if last else 0)
    for size in straddling_sizes(g, intra) if n > g else ():  # one tiling of the domain, across nodes
        forward = np.arange(0, n - size + 1, size, dtype=np.int64)
        parts.append(np.stack([forward, np.full_like(forward, size)], axis=1))
    for size in ladder(2 * g - 1, steps):
        if size > g and n >= 2 * g:  # tilings of the domain from either end, across node boundaries
            forward = np.arange(0, n - size + 1, size, dtype=np.int64)
            parts += [np.stack([forward, np.full_like(forward, size)], axis=1),
                      np.stack([n - size - forward, np.full_like(forward, size)], axis=1)]
    for k in ladder(nodes, steps):
        if k >= 2:
            first = np.arange(0, nodes - k + 1, k, dtype=np.int64) * g
            parts.append(np.stack([first, np.minimum(first + k * g, n) - first], axis=1))
    if n > 1:
        parts.append(np.array([[0, n]], dtype=np.int64))
    windows = np.unique(np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64), axis=0)
    return windows[np.lexsort((windows[:, 0], windows[:, 1]))]


def _membership(world_size: int, windows: np.ndarray) -> np.ndarray:
    """How many windows hold each position."""
    diff = np.zeros(world_size + 1, dtype=np.int64)
    np.add.at(diff, windows[:, 0], 1)
    np.add.at(diff, windows[:, 0] + windows[:, 1], -1)
    return np.cumsum(diff[:-1])


@dataclass(frozen=True)
class GroupFamily:
    """The fixed multi-rank groups of a job: contiguous windows, in one creation order (see the module doc)."""

    world_size: int
    gpus_per_node: int
    max_groups_per_rank: int
    steps_per_octave: int
    """p of the size ladder the builder chose: consecutive sizes differ by at most 1 + 1/p."""
    windows: tuple[tuple[int, int], ...]
    """(start, size) of every group, in creation order: by size, then start."""
    _starts: dict[int, np.ndarray] = field(init=False, repr=False, compare=False)
    _at: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _set: frozenset[tuple[int, int]] = field(init=False, repr=False, compare=False)
    _start_bits: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts: dict[int, list[int]] = {1: list(range(self.world_size))}
        at: dict[int, list[int]] = {}
        for start, size in self.windows:
            starts.setdefault(size, []).append(start)
            at.setdefault(start, []).append(size)
        object.__setattr__(self, "_starts", {s: np.array(v, dtype=np.int64) for s, v in sorted(starts.items())})
        object.__setattr__(self, "_at", {a: tuple(sorted(v, reverse=True)) for a, v in at.items()})
        object.__setattr__(self, "_set", frozenset(self.windows))
        object.__setattr__(self, "_start_bits", {})

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Every group as a sorted tuple of domain positions, in creation order."""
        return tuple(tuple(range(a, a + s)) for a, s in self.windows)

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every group size with at least one window, ascending (1: a single rank, never a communicator)."""
        return tuple(self._starts)

    @property
    def membership(self) -> np.ndarray:
        """Groups each domain position belongs to."""
        return _membership(self.world_size, np.array(self.windows, dtype=np.int64).reshape(-1, 2))

    @property
    def max_membership(self) -> int:
        """The most groups any position belongs to (<= max_groups_per_rank)."""
        return int(self.membership.max(initial=0))

    def summary(self) -> str:
        """One line: how many groups, the most per rank, and the bound and ladder that gave them."""
        return (f"group family: {len(self)} groups, at most {self.max_membership} per rank "
                f"(max_groups_per_rank {self.max_groups_per_rank}, {self.steps_per_octave} sizes per octave)")

    def starts(self, size: int) -> np.ndarray:
        """Sorted first positions of the windows of `size` ranks (empty if the size is not in the family)."""
        return self._starts.get(size, np.zeros(0, dtype=np.int64))

    def placements(self, size: int) -> list[tuple[int, ...]]:
        """The groups of `size` ranks, by first position."""
        return [tuple(range(a, a + size)) for a in self.starts(size).tolist()]

    def contains(self, ranks: tuple[int, ...] | list[int]) -> bool:
        """Whether these positions (any order) form a family group; one position always does."""
        r = sorted(ranks)
        if len(r) <= 1:
            return True
        return r[-1] - r[0] + 1 == len(r) and len(set(r)) == len(r) and (r[0], len(r)) in self._set

    def ceil_size(self, degree: int) -> int:
        """The smallest family size >= degree (a planner gives a sample of that degree this many ranks)."""
        sizes = self.sizes
        k = int(np.searchsorted(sizes, degree))
        if k == len(sizes):
            raise DhpError(f"no group of {degree} ranks fits the domain of {self.world_size}")
        return sizes[k]

    def first_free(self, size: int, free: int) -> int | None:
        """The first start of a window of `size` ranks whose positions are all set in the bit mask `free`
        (bit r: position r), or None. A few shifts of one integer, not a test per window: planners ask
        this thousands of times per solve."""
        if size not in self._starts:
            return None
        if size not in self._start_bits:
            self._start_bits[size] = sum(1 << a for a in self._starts[size].tolist())
        run, span = free, 1  # bit a of run: positions a .. a + span - 1 all free
        while 2 * span <= size:
            run &= run >> span
            span *= 2
        hits = run & (run >> (size - span)) & self._start_bits[size]
        return (hits & -hits).bit_length() - 1 if hits else None

    def largest_at(self, start: int, limit: int) -> int:
        """The widest group that starts at `start` and has at most `limit` ranks (1 if none)."""
        return next((s for s in self._at.get(start, ()) if s <= limit), 1)


@functools.lru_cache(maxsize=64)
def group_family(world_size: int, gpus_per_node: int,
                 max_groups_per_rank: int = DEFAULT_MAX_GROUPS_PER_RANK) -> GroupFamily:
    """The family of this domain: the finest ladder whose groups per rank stay <= max_groups_per_rank.

    Deterministic (the same tuple on every rank and run); cached, since planners ask once per solve.
    """
    if world_size < 1 or gpus_per_node < 1:
        raise DhpError(f"a group family needs world_size >= 1 and gpus_per_node >= 1, got {world_size}, {gpus_per_node}")
    for steps in LADDER_STEPS:
        windows = _windows(world_size, gpus_per_node, steps)
        if int(_membership(world_size, windows).max(initial=0)) <= max_groups_per_rank:
            return GroupFamily(world_size, gpus_per_node, max_groups_per_rank, steps, tuple(map(tuple, windows.tolist())))
    need = int(_membership(world_size, windows).max(initial=0))
    raise DhpError(f"max_groups_per_rank = {max_groups_per_rank} is below the smallest family of N = {world_size} "
                   f"ranks with {gpus_per_node} per node ({need} groups per rank with power-of-two sizes only); "
                   f"raise it (or 0: no family)")
