"""The comm policy: which groups a job has, how each one talks, and what its communicators cost.

One frozen value, built once per job from what the user wrote (`comm`, `layer_spec`, `max_groups_per_rank`)
and the domain, answers every question about communicators; the planners, the group pool, the step engine,
the CLI, the benches and `selftest` ask it instead of deciding again:

- `planning_family`: the group family a planner must keep to, or None when it may form any group;
- `startup_groups`: the groups created once, collectively, at start-up (the family, under a comm that gives a
  group its own communicator);
- `creates_later`: whether a step can still create a communicator (only when planners form groups freely
  under a comm that needs one per group);
- `transport(ranks)`: how one group's attention talks (`mixed` resolves here, group by group);
- `memory_per_rank_mb`: the communicators' GPU memory on the busiest rank, at `communicator_mb` each;
- `gathers_kv`: whether a group's ranks keep its whole keys and values for the backward (the memory rule's g).

Pure: no torch, no process group, so every answer is testable on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.family import DEFAULT_MAX_GROUPS_PER_RANK, GroupFamily, group_family

COMM_VARIANTS: dict[str, str] = {
    "allgather": "K/V all-gather, dK/dV reduce-scatter",
    "ring": "P2P ring of K/V blocks",
    "ulysses": "Ulysses all-to-all of heads",
    "p2p": "ring of K/V blocks by point-to-point on the domain's communicator: no communicator per group",
}
"""How one group's context-parallel attention talks (the runtime holds one function per name)."""

DOMAIN_COMMS: frozenset[str] = frozenset({"p2p"})
"""Variants that address a group's members by global rank on the domain's own communicator, so a group
needs no process group of its own."""

STEP_COMMS: dict[str, str] = {
    **COMM_VARIANTS,
    "mixed": "allgather on the group family's communicators (created at start-up); any other group runs the p2p "
             "ring on the domain's communicator",
}
"""What a user may choose for a step: one variant for every group, or `mixed`, resolved group by group."""

LAYER_SPECS: dict[str, str] = {
    "local": "megatron-dhp's core attention (any device, any linear layers)",
    "te": "TransformerEngine's core attention (GPU; --transformer-impl transformer_engine)",
}
"""Which core attention the layer spec holds (`runtime.layer_spec.dhp_layer_spec`)."""

DEFAULT_COMMUNICATOR_MB = 600.0
"""GPU memory one NCCL communicator takes: 389 MiB measured for its fixed part on an H200 (NCCL 2.28, one
rank; peer buffers come on top with more ranks), 544-688 MB reported per communicator on 4 x A100
(NVIDIA/nccl #964); docs/results.md."""


@dataclass(frozen=True)
class CommPolicy:
    """The job's communicators: built by `CommPolicy.resolve`, asked by every layer that needs one."""

    comm: str
    """The step comm as the user wrote it (`STEP_COMMS`)."""
    layer_spec: str
    """`LAYER_SPECS`: TransformerEngine's attention needs a process group per group, so it cannot run p2p."""
    max_groups_per_rank: int
    """K of the group family (`plan.family`); 0: none."""
    world_size: int
    gpus_per_node: int
    communicator_mb: float = DEFAULT_COMMUNICATOR_MB

    def __post_init__(self) -> None:
        for name, value, allowed in (("comm", self.comm, STEP_COMMS), ("layer_spec", self.layer_spec, LAYER_SPECS)):
            if value not in allowed:
                raise DhpError(f"{name} {value!r} is unknown; choose one of {', '.join(allowed)}")
        if self.layer_spec == "te" and self.comm in DOMAIN_COMMS:
            raise DhpError(f"comm {self.comm!r} gives a group no process group, which TransformerEngine's attention "
                           "needs; use layer_spec local with it, or another comm")
        if self.max_groups_per_rank < 0:
            raise DhpError(f"max_groups_per_rank = {self.max_groups_per_rank} must be >= 0 (0: no group family)")
        if self.communicator_mb < 0:
            raise DhpError(f"communicator_mb = {self.communicator_mb} must be >= 0")

    @classmethod
    def resolve(cls, comm: str, *, layer_spec: str = "local", max_groups_per_rank: int | None = None,
                keeps_to_family: bool = True, world_size: int, gpus_per_node: int,
                communicator_mb: float = DEFAULT_COMMUNICATOR_MB) -> CommPolicy:
        """The policy of a job. `max_groups_per_rank` None takes the default: under `mixed` the family of
        `DEFAULT_MAX_GROUPS_PER_RANK` runs allgather; under a comm that holds planners to a family, a planner
        that `keeps_to_family` (dhp) gets that family and a peer, which plans as published, none."""
        policy = cls(comm, layer_spec, max_groups_per_rank or 0, world_size, gpus_per_node, communicator_mb)
        if max_groups_per_rank is None and (policy.effective_comm == "mixed" or keeps_to_family):
            return replace(policy, max_groups_per_rank=DEFAULT_MAX_GROUPS_PER_RANK)
        return policy

    @property
    def effective_comm(self) -> str:
        """The comm the step runs: `mixed` is `allgather` under TransformerEngine's attention (no p2p path)."""
        return "allgather" if self.comm == "mixed" and self.layer_spec == "te" else self.comm

    @property
    def any_group(self) -> bool:
        """Whether a group outside the family costs no communicator, so planners may form any group."""
        return self.effective_comm in ("mixed", *DOMAIN_COMMS)

    @functools.cached_property
    def family(self) -> GroupFamily | None:
        """The family created at start-up: none under a comm that needs no process group, or with K = 0."""
        if self.effective_comm in DOMAIN_COMMS or not self.max_groups_per_rank:
            return None
        return group_family(self.world_size, self.gpus_per_node, self.max_groups_per_rank)

    @property
    def planning_family(self) -> GroupFamily | None:
        """The family planners keep to; None: any group."""
        return None if self.any_group else self.family

    @property
    def startup_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups every rank creates once at start-up, in the family's one order."""
        return self.family.groups if self.family is not None else ()

    @property
    def creates_later(self) -> bool:
        """Whether a step may create a communicator: planners form groups freely and each needs one."""
        return not self.any_group and self.family is None

    def transport(self, ranks: Sequence[int]) -> str:
        """The variant a group runs (`COMM_VARIANTS`): under `mixed` allgather on a family group, else p2p."""
        comm = self.effective_comm
        if comm != "mixed":
            return comm
        return "allgather" if len(ranks) == 1 or (self.family is not None and self.family.contains(ranks)) else "p2p"

    def on_domain(self, groups: Iterable[Sequence[int]]) -> int:
        """How many of these groups run on the domain's communicator (`DOMAIN_COMMS`) rather than their own."""
        return sum(self.transport(ranks) in DOMAIN_COMMS for ranks in groups)

    @property
    def communicators_per_rank(self) -> int:
        """The most start-up communicators one rank joins (groups created later come on top)."""
        return self.family.max_membership if self.family is not None else 0

    @property
    def memory_per_rank_mb(self) -> float:
        """GPU memory of the start-up communicators on the busiest rank."""
        return self.communicators_per_rank * self.communicator_mb

    @property
    def gathers_kv(self) -> bool:
        """Whether some group's ranks each keep the group's whole keys and values for the backward: allgather
        and mixed's family groups (the memory rule is per sample, so it counts for mixed's p2p groups too), and
        TransformerEngine's attention, whose all_gather does (counted for its p2p too: the job's cp_comm_type is
        Megatron-LM's, not the policy's)."""
        comm = self.effective_comm
        return self.layer_spec == "te" or comm == "allgather" or (comm == "mixed" and self.family is not None)

    def for_profiling(self) -> CommPolicy:
        """The policy `profile` times groups under: every group on its own communicator, created on demand,
        talking as the family's groups do under this policy (so `mixed` is timed as allgather)."""
        comm = "allgather" if self.effective_comm == "mixed" else self.effective_comm
        return replace(self, comm=comm, max_groups_per_rank=0)

    def summary(self) -> str:
        """One line for the start-up log: what is created, how groups talk, and the memory it takes."""
        comm = self.comm if self.comm == self.effective_comm else f"{self.comm} (as {self.effective_comm})"
        planning = "any group" if self.planning_family is None else "the family"
        later = "; each group is created when a plan first needs it" if self.creates_later else ""
        return (f"comm {comm}: {len(self.startup_groups)} groups created at start-up, at most "
                f"{self.communicators_per_rank} per rank (~{self.memory_per_rank_mb / 1024:.1f} GB at "
                f"{self.communicator_mb:.0f} MB each); planners use {planning}{later}")
