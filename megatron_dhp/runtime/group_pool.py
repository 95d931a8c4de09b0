"""Process groups for the rank sets of the plans, created collectively in plan order and cached.

A group is keyed by its sorted tuple of domain positions; the same key in every domain (one per TP/PP
coordinate) maps to a different set of global ranks, and all of them are created together.

Why every rank of the world creates every group (`new_group` without `use_local_synchronization`):
torch names a locally synchronised group by hashing its ranks *and the number of groups this process
already has*, so two members with different histories (one was in an earlier group, the other was not)
compute different names and wait for each other forever (seen with gloo on torch 2.13). World-wide
creation names groups by a global counter that advances identically everywhere, provided every rank runs
the same sequence of `prepare` calls on the same plans, which invariant 3 (one plan everywhere) gives.
Non-members return immediately, so the cost is a counter step per group and domain.

A pool given a group family (`plan.family`) creates all of it in `__init__`, in the family's one order, and
keeps it for the whole job; a plan held to that family then finds every group already there, so no step
creates or destroys a communicator (`created` stays 0: the training log, `selftest` and a test show it).
A group outside the family is still created on demand and cached under the LRU rule, except where the comm
policy runs it on the domain's communicator instead (`plan.comm.CommPolicy.transport`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.domain import DynamicDomain

GroupKey = tuple[int, ...]

SHARE_RESOURCES = "NCCL_COMM_SPLIT_SHARE_RESOURCES"
"""NCCL reads it when it first splits a communicator: 1 lets the children share their parent's buffers."""


def nccl_sharing() -> str | None:
    """Whether the communicators this process creates from now on share NCCL resources, as one line for the
    start-up log (None off NCCL). torch creates a new group by splitting the default one (`ncclCommSplit`) when
    that is bound to a device (`init_process_group(device_id=...)`); NCCL then shares the parent's buffers
    if `NCCL_COMM_SPLIT_SHARE_RESOURCES=1` was set before its first split (`runtime.distributed.init_distributed`
    does both; scripts/pretrain_gpt_dhp.sh exports the variable)."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return None
    bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    shared = os.environ.get(SHARE_RESOURCES) == "1"
    if bound and shared:
        return "NCCL: groups split from the default communicator, sharing its resources"
    fix = [] if bound else ["bind the default group to a device (init_process_group(device_id=...))"]
    fix += [] if shared else [f"export {SHARE_RESOURCES}=1 before the job starts"]
    return f"NCCL: groups {'split but not sharing resources' if bound else 'not split'}; to share, {' and '.join(fix)}"


class GroupPool:
    """The dynamic groups of a domain, identical in content and order on every rank: a fixed family created
    at start-up plus an LRU cache of any others."""

    def __init__(self, domain: DynamicDomain, *, max_groups: int = 256, timeout: timedelta | None = None,
                 family: Sequence[GroupKey] = ()) -> None:
        """Collective when `family` is given: every rank of the world creates it in the given order."""
        if max_groups < 1:
            raise DhpError(f"max_groups = {max_groups} must be >= 1")
        self.domain = domain
        self.max_groups = max_groups
        self.timeout = timeout if timeout is not None else domain.timeout
        self._fixed: dict[GroupKey, dist.ProcessGroup | None] = {}
        for key in family:
            if len(key) > 1 and key not in self._fixed:
                self._fixed[key] = self._create(key)
        self.at_startup = len(self._fixed)
        """Rank sets of the family, created in `__init__` and kept to the end."""
        self._groups: OrderedDict[GroupKey, dist.ProcessGroup | None] = OrderedDict()
        self.created = 0
        """Rank sets created after start-up, by `prepare` (each is one communicator per domain)."""
        self.hits = 0
        """Rank sets a plan needed that were already cached."""
        self.released = 0
        """Rank sets evicted (their communicators destroyed) to stay under `max_groups`."""

    def __len__(self) -> int:
        return len(self._fixed) + len(self._groups)

    def __contains__(self, ranks: object) -> bool:
        if not isinstance(ranks, tuple):
            return False
        key = tuple(sorted(ranks))
        return key in self._fixed or key in self._groups

    @property
    def family(self) -> tuple[GroupKey, ...]:
        """The rank sets created at start-up, in creation order."""
        return tuple(self._fixed)

    def prepare(self, plan: Plan) -> None:
        """Create the plan's missing groups, in plan order. Collective: every rank of the world calls it."""
        keys = plan.multi_rank_groups()
        needed = [key for key in keys if key not in self._fixed]
        self.hits += len(keys) - len(needed)
        if len(needed) > self.max_groups:
            raise DhpError(
                f"the plan uses {len(needed)} distinct multi-rank groups outside the family, above the pool cap of "
                f"{self.max_groups}; raise max_groups"
            )
        for key in needed:
            if key in self._groups:
                self._groups.move_to_end(key)
                self.hits += 1
            else:
                self._groups[key] = self._create(key)
                self.created += 1
        while len(self._groups) > self.max_groups:
            _, group = self._groups.popitem(last=False)
            if group is not None:
                dist.destroy_process_group(group)
            self.released += 1

    def summary(self) -> str:
        """One line of what the pool created: the family at start-up, then anything after it."""
        return (f"groups: {self.at_startup} created at start-up, {self.created} created after start-up, "
                f"{self.hits} cached hits, {self.released} released")

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """This rank's process group for a rank set it belongs to; None for a group of one rank."""
        if len(ranks) == 1:
            return None
        key = tuple(sorted(ranks))
        if self.domain.position not in key:
            raise DhpError(f"domain position {self.domain.position} is not in group {key}")
        if key in self._fixed:
            return self._fixed[key]
        if key not in self._groups:
            raise DhpError(f"group {key} was not prepared; call GroupPool.prepare(plan) on every rank first")
        return self._groups[key]

    def _create(self, key: GroupKey) -> dist.ProcessGroup | None:
        mine = None
        for domain in self.domain.all_domains:
            group = dist.new_group([domain[p] for p in key], timeout=self.timeout)
            if domain == self.domain.global_ranks and self.domain.position in key:
                mine = group
        return mine
