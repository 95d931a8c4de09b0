"""Random valid plans: the adversary for runtime checks (`selftest`, tests), not a planner to train with.

They exercise what real planners produce and more: group sizes that are not powers of two, groups over
non-contiguous ranks, several phases with re-formed groups (ranks may sit a phase out), groups with no
work, several samples per microbatch.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from megatron_dhp.cost.config import Domain
from megatron_dhp.plan.family import GroupFamily
from megatron_dhp.plan.memory import MemoryRule
from megatron_dhp.plan.plan import Plan, PlanGroup, memory_fields
from megatron_dhp.workload.batches import fit_to_domain
from megatron_dhp.workload.sample import Batch, Sample


def random_partition(ranks: list[int], rng: random.Random, *, contiguous: bool) -> list[tuple[int, ...]]:
    """Cut `ranks` into groups of random sizes (1..len), optionally after shuffling them."""
    ranks = list(ranks)
    if not contiguous:
        rng.shuffle(ranks)
    groups = []
    while ranks:
        size = rng.randint(1, len(ranks))
        groups.append(tuple(ranks[:size]))
        ranks = ranks[size:]
    return groups


def family_partition(world_size: int, family: GroupFamily, rng: random.Random) -> list[tuple[int, ...]]:
    """Cut positions 0..N-1 into groups of the family (single ranks included), each a random one of those that
    start where the previous ended."""
    groups, start = [], 0
    while start < world_size:
        size = rng.choice([s for s in family.sizes if start + s <= world_size and family.contains(range(start, start + s))])
        groups.append(tuple(range(start, start + size)))
        start += size
    return groups


def random_plan(
    batch: Batch,
    domain: Domain,
    rng: random.Random,
    *,
    max_phases: int = 2,
    max_samples_per_microbatch: int = 3,
    family: GroupFamily | None = None,
    memory: MemoryRule | None = None,
    uneven: float = 0.0,
) -> Plan:
    """A valid plan with random groups, phases and microbatches for `batch` on `domain`.

    Phase 0 covers every rank; later phases re-partition a random subset of the ranks (and if no group is
    wide enough for the longest sample, a last phase runs the whole domain). Each sample goes to a random
    group that can hold it under the `memory` rule (default: length <= group size x max_tokens_per_rank).
    With a `family` every group is one of it (a later phase keeps a random subset of a partition into family
    groups). With probability `uneven` a group of several ranks with work gets random shares of 1..4 each
    (`plan.shares`), as uneven as its microbatches' memory lets them be.
    """
    n, cap = domain.world_size, domain.max_tokens_per_rank
    memory = memory or MemoryRule(cap)
    fit_to_domain(batch, domain.capacity)
    footprint = memory.check(batch.samples, n)
    need = dict(zip((s.id for s in batch.samples), footprint.min_degree().tolist()))
    position = {s.id: k for k, s in enumerate(batch.samples)}
    layout: list[tuple[int, tuple[int, ...]]] = []
    for phase in range(rng.randint(1, max_phases)):
        if family is not None:
            parts = family_partition(n, family, rng)
            kept = parts if phase == 0 else rng.sample(parts, rng.randint(1, len(parts)))
            layout += [(phase, g) for g in sorted(kept)]
            continue
        ranks = list(range(n)) if phase == 0 else sorted(rng.sample(range(n), rng.randint(1, n)))
        layout += [(phase, g) for g in random_partition(ranks, rng, contiguous=rng.random() < 0.5)]
    widest = max(need.values())
    if all(len(g) < widest for _, g in layout):
        layout.append((layout[-1][0] + 1, tuple(range(n))))  # a last phase on the whole domain for the longest

    buckets: list[list[Sample]] = [[] for _ in layout]
    for s in rng.sample(list(batch.samples), len(batch.samples)):
        fits = [i for i, (_, g) in enumerate(layout) if need[s.id] <= len(g)]
        buckets[rng.choice(fits)].append(s)

    def shares(ranks: tuple[int, ...], microbatches: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        if not uneven or len(ranks) < 2 or not microbatches or rng.random() >= uneven:
            return ()
        drawn = tuple(rng.randint(1, 4) for _ in ranks)
        return footprint.fitting_shares(drawn, [[position[i] for i in mb] for mb in microbatches], len(ranks))

    groups = []
    for (phase, ranks), bucket in zip(layout, buckets):
        microbatches = _microbatches(bucket, lambda mb, d: footprint.fits([position[i] for i in mb], d), len(ranks),
                                     max_samples_per_microbatch, rng)
        groups.append(PlanGroup(ranks=ranks, phase=phase, microbatches=microbatches, shares=shares(ranks, microbatches)))
    plan = Plan(
        planner="random",
        world_size=n,
        gpus_per_node=domain.gpus_per_node,
        samples=batch.samples,
        groups=groups,
        max_tokens_per_rank=cap,
        **memory_fields(memory),
    )
    plan.validate()
    return plan


def _microbatches(samples: list[Sample], fits: Callable[[list[int], int], bool], degree: int, max_samples: int,
                  rng: random.Random) -> tuple[tuple[int, ...], ...]:
    """Split a group's samples into runs of 1..max_samples samples that each `fits` the group's `degree` ranks."""
    out: list[tuple[int, ...]] = []
    current: list[Sample] = []
    target = rng.randint(1, max_samples)
    for s in samples:
        if current and (len(current) >= target or not fits([c.id for c in (*current, s)], degree)):
            out.append(tuple(c.id for c in current))
            current, target = [], rng.randint(1, max_samples)
        current.append(s)
    if current:
        out.append(tuple(c.id for c in current))
    return tuple(out)
