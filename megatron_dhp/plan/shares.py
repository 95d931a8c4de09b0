"""Uneven shards: how much of each sample every rank of a group holds, so that ranks of different speeds
finish together.

A group of d ranks may carry `shares`, one positive integer per rank (absent: every rank holds the same, the
zigzag layout of `runtime.layout`). A sample of L tokens is then cut into d pairs of chunks: rank r holds a
front chunk and its mirror from the back, both c_r tokens long, front chunks in rank order from position 0 and
back chunks in reverse rank order from the end (the even zigzag is the case of equal c_r). Whatever its offset,
a chunk pair of c_r tokens each holds c_r (L + 1) causal query-key pairs (the front chunk's queries see
fewer keys by as many as the back chunk's see more), so a rank's linear work (its 2 c_r tokens) and its
attention work both follow c_r: sized in proportion to the rank's speed, every member finishes its compute
at once.

`shard_chunks` is the one rule that turns shares into chunk sizes; the runtime's layout, the memory rule and
the cost model all ask it (or `share_fractions`, its limit for long samples).

Pricing (`pace`): with shares w the compute of a sample of W seconds takes W max_r(phi_r / s_r) (phi_r =
w_r / sum w), i.e. runs at speed v = 1 / (d max_r(phi_r / s_r)): the mean speed when shares follow speeds,
the slowest's when they are even. Communication pads every rank's block to the largest
(all-gather and ring pass equal blocks; an uneven all-to-all waits for its largest send), so it costs
d phi_max times the even split's. Per-microbatch and per-sample fixed costs run whole on every rank: at the
slowest member's speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

SHARE_RESOLUTION = 1000
"""`shares_for_speeds` writes a speed as an integer share of this many parts of the fastest member's."""


def normalize_shares(shares: Sequence[int], size: int) -> tuple[int, ...]:
    """`shares` as a tuple of positive ints, one per rank, reduced by their gcd; () when even (or absent).

    Raises ValueError naming the value: a wrong count or a share below 1."""
    if not len(shares):
        return ()
    if len(shares) != size:
        raise ValueError(f"shares {list(shares)} give {len(shares)} values for a group of {size} ranks; give one "
                         "per rank, or none for even shards")
    out = []
    for v in shares:
        if isinstance(v, bool) or int(v) != v or int(v) < 1:
            raise ValueError(f"share {v!r} must be a positive integer (a rank's part of each sample)")
        out.append(int(v))
    g = math.gcd(*out)
    out = [v // g for v in out]
    return () if len(set(out)) == 1 else tuple(out)


def chunk_unit(seq_multiple: int = 1) -> int:
    """Chunk sizes are multiples of this, so that a rank's shard (two chunks) divides by `seq_multiple`."""
    return seq_multiple // math.gcd(seq_multiple, 2)


def shard_chunks(length: int, shares: Sequence[int], seq_multiple: int = 1) -> tuple[int, ...]:
    """c_r of every rank for a sample of `length` tokens under uneven `shares` (a rank holds 2 c_r tokens).

    Q = max(d, ceil(L / 2u)) chunk units of u = `chunk_unit` tokens: one unit per rank, the other Q - d split
    in proportion to the shares by largest remainder (ties to the lower rank), so the padded sample is 2 u Q
    tokens, padding at its end."""
    d, total, u = len(shares), sum(shares), chunk_unit(seq_multiple)
    units = max(d, -(-length // (2 * u)))
    spare = units - d
    base = [spare * w // total for w in shares]
    left = spare - sum(base)
    order = sorted(range(d), key=lambda r: (-(spare * shares[r] % total), r))
    for r in order[:left]:
        base[r] += 1
    return tuple(u * (1 + q) for q in base)


def share_fractions(shares: Sequence[int], size: int) -> np.ndarray:
    """phi_r: each rank's part of a long sample (1 / d each when `shares` is empty)."""
    if not len(shares):
        return np.full(size, 1.0 / size)
    w = np.asarray(shares, dtype=np.float64)
    return w / w.sum()


def as_shares(parts: np.ndarray | Sequence[float]) -> tuple[int, ...]:
    """Positive real `parts` as integer shares, `SHARE_RESOLUTION` for the largest (`normalize_shares`: () when
    they are equal)."""
    parts = np.asarray(parts, dtype=np.float64)
    return normalize_shares(np.maximum(1, np.rint(SHARE_RESOLUTION * parts / parts.max())).astype(int).tolist(),
                            parts.size)


def shares_for_speeds(speeds: Sequence[float]) -> tuple[int, ...]:
    """Shares in proportion to the members' speeds (() when they are equal)."""
    return as_shares(speeds)


def blend(limit: np.ndarray | float, size: np.ndarray | int, phi_max: np.ndarray | float) -> np.ndarray:
    """alpha in [0, 1]: how far from even shares (0) toward shares in proportion to speeds (1, whose largest
    part is `phi_max`) a group of `size` ranks may go when its fullest rank may hold at most `limit` of a
    sample (memory: (cap - held) / shared, `plan.memory.Footprint`). The largest part of the mix alpha phi +
    (1 - alpha) / d is alpha phi_max + (1 - alpha) / d."""
    even = 1.0 / np.asarray(size, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = (np.asarray(limit, dtype=np.float64) - even) / (np.asarray(phi_max, dtype=np.float64) - even)
    return np.clip(np.where(np.isnan(alpha), 1.0, alpha), 0.0, 1.0)  # +-inf clip to 1 and 0


def blended_pace(alpha: np.ndarray | float, size: np.ndarray | int, speed_sum: np.ndarray | float,
                 slowest: np.ndarray | float, fastest: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """(v, comm scale) of `pace` for the mix `alpha` of speed-proportional and even shares, from the group's
    size, speed sum, slowest and fastest speed alone (vectorised: planners price every window at once).
    Rank r holds alpha s_r / S + (1 - alpha) / d; over its speed that is largest on the slowest, so
    v = 1 / (alpha d / S + (1 - alpha) / s_min), and the largest part is alpha s_max / S + (1 - alpha) / d."""
    d = np.asarray(size, dtype=np.float64)
    speed = 1.0 / (alpha * d / speed_sum + (1.0 - alpha) / slowest)
    return speed, alpha * d * fastest / speed_sum + 1.0 - alpha


def mix(shares: Sequence[int], alpha: float) -> tuple[int, ...]:
    """`shares` mixed with even ones, alpha of the way to them (`blend`), as integer shares."""
    return as_shares(alpha * share_fractions(shares, len(shares)) + (1.0 - alpha) / len(shares))


MIX_STEPS = 12
"""`shares_within` bisects the mix this many times where integer rounding takes the exact one past the limit
(near a full microbatch the group's speed moves fast with the mix: a tenth of it cost 8 % on a 15-rank group
with one rank at half speed)."""


def shares_within(shares: Sequence[int], limit: float, fits: Callable[[tuple[int, ...]], bool]) -> tuple[int, ...]:
    """`shares` mixed toward even (`blend`, `mix`) so that no rank holds more than `limit` of a sample, as
    `fits` checks exactly: the mix `blend` allows, or where integer shares round past it the largest that fits
    (bisected); () where only even shards fit (they do wherever the plan does)."""
    if not len(shares):
        return ()
    phi_max = share_fractions(shares, len(shares)).max()
    high = float(blend(limit, len(shares), phi_max))
    best = mix(shares, high)  # (even, () at alpha 0)
    if not best or fits(best):
        return best
    # integer parts of SHARE_RESOLUTION round the largest share by at most a part or so: aim that much lower
    best = mix(shares, float(blend(limit * (1 - 2 / SHARE_RESOLUTION), len(shares), phi_max)))
    if best and fits(best):
        return best
    low, best = 0.0, ()
    for _ in range(MIX_STEPS):
        middle = (low + high) / 2
        mixed = mix(shares, middle)
        if fits(mixed):
            low, best = middle, mixed
        else:
            high = middle
    return best


@dataclass(frozen=True)
class Pace:
    """How fast a group runs its samples (the module docstring): what the cost model divides by."""

    speed: float
    """v: the split compute's speed."""
    slowest: float
    """The slowest member's speed: what fixed per-rank costs (and communication, where it scales) run at."""
    comm_scale: float = 1.0
    """d phi_max: the communication against the even split's."""


def pace(speeds: Sequence[float], shares: Sequence[int] = ()) -> Pace:
    """The `Pace` of a group whose members run at `speeds` with `shares` (empty: even)."""
    s = np.asarray(speeds, dtype=np.float64)
    slowest = float(s.min())
    if not len(shares):
        return Pace(slowest, slowest)
    phi = share_fractions(shares, s.size)
    return Pace(float(1.0 / (s.size * np.max(phi / s))), slowest, float(s.size * phi.max()))
