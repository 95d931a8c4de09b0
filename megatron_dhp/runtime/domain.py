"""The dynamic domain at run time: which global ranks the plan's rank positions stand for.

A plan speaks of positions 0..N-1 inside the domain (Megatron's DP x CP ranks that share one TP/PP
coordinate). There is one such domain per TP/PP coordinate and all of them execute the same plan; group
creation is collective over the whole world, so every rank also knows every other domain.
Constructible without a process group (tests, planning); `from_parallel_state` reads a live job, and on NCCL
gives the domain host (gloo) groups for each step's control collectives (`ControlPlane`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dhp.errors import DhpError


@dataclass(frozen=True)
class ControlPlane:
    """gloo groups beside a job's NCCL ones that carry each step's control collectives on the host (the length
    gather, the plan's broadcast and check, the token move): their results are read on the host, and over
    NCCL every such read would first wait for the GPU to drain its queue."""

    domain: dist.ProcessGroup
    """Over this rank's domain."""
    world: dist.ProcessGroup
    """Over every rank of the job."""


@dataclass(frozen=True)
class DynamicDomain:
    """This rank's domain, its place in it, and every domain of the world."""

    global_ranks: tuple[int, ...]
    """Global rank of each domain position, increasing (Megatron's rank generator orders them so)."""
    rank: int
    """This process's global rank."""
    all_domains: tuple[tuple[int, ...], ...]
    """Every domain of the world (one per TP/PP coordinate), each as its `global_ranks`."""
    group: dist.ProcessGroup | None = None
    """A process group over exactly `global_ranks`, for the step's gathers and all-to-all (None: the world)."""
    timeout: timedelta = timedelta(seconds=120)
    """How long any collective of the runtime may wait before failing instead of hanging."""
    control: ControlPlane | None = None
    """Host groups for the control collectives (`control_plane`); None: they run on `group` and the world."""

    def __post_init__(self) -> None:
        ranks = self.global_ranks
        if not ranks or list(ranks) != sorted(set(ranks)):
            raise DhpError(f"domain ranks {ranks} must be distinct and increasing")
        if self.rank not in ranks:
            raise DhpError(f"rank {self.rank} is not in its domain {ranks}")
        if ranks not in self.all_domains:
            raise DhpError(f"domain {ranks} is missing from the list of all domains")
        if any(len(d) != len(ranks) for d in self.all_domains):
            raise DhpError(f"domains differ in size: {sorted({len(d) for d in self.all_domains})}")

    @property
    def size(self) -> int:
        """N: the number of rank positions a plan of this domain must have."""
        return len(self.global_ranks)

    @property
    def position(self) -> int:
        """This rank's position in the domain (its rank in plan terms)."""
        return self.global_ranks.index(self.rank)

    @property
    def device(self) -> torch.device:
        """Where the step's collectives want their tensors: the current CUDA device for NCCL, else (gloo, or no
        process group at all) the CPU."""
        if not dist.is_initialized():
            return torch.device("cpu")
        group = self.group if self.group is not None else dist.group.WORLD
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def control_plane(self, *, world: bool = False) -> tuple[dist.ProcessGroup | None, torch.device]:
        """The group (None: the default one) and device of a control collective over the domain, or over the
        world: gloo on the host when the job has a `ControlPlane`, else the domain's own group and device."""
        if self.control is not None:
            return (self.control.world if world else self.control.domain), torch.device("cpu")
        return (None if world else self.group), self.device

    def with_control_plane(self) -> DynamicDomain:
        """This domain with host groups for its control collectives when the job's collectives run on NCCL
        (itself otherwise: gloo already runs on the host). World-collective: every rank calls it once."""
        if self.control is not None or self.device.type == "cpu":
            return self
        mine = host_groups(self.all_domains, self.timeout)[self.global_ranks]
        return replace(self, control=ControlPlane(mine, dist.new_group(backend="gloo", timeout=self.timeout)))

    @classmethod
    def from_parallel_state(cls, *, timeout: timedelta = timedelta(seconds=120)) -> DynamicDomain:
        """The domain of a job set up with `parallel_state.initialize_model_parallel` (static CP of 1).

        One collective over the world (every rank must call it) tells each rank the other domains.
        """
        from megatron.core import parallel_state

        if parallel_state.get_context_parallel_world_size() != 1:
            raise DhpError(
                f"static context-parallel size is {parallel_state.get_context_parallel_world_size()}; "
                "megatron-dhp forms CP groups itself, set --context-parallel-size 1"
            )
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        ranks = tuple(dist.get_process_group_ranks(group))
        domains: list[tuple[int, ...]] = [()] * dist.get_world_size()
        dist.all_gather_object(domains, ranks)
        return cls(
            global_ranks=ranks,
            rank=dist.get_rank(),
            all_domains=tuple(sorted(set(map(tuple, domains)))),
            group=group,
            timeout=timeout,
        ).with_control_plane()


def host_groups(rank_sets: Sequence[tuple[int, ...]], timeout: timedelta) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A gloo group over each of `rank_sets`, created in their order on every rank (group creation is
    world-collective; a rank outside a set gets torch's non-member marker for it)."""
    return {ranks: dist.new_group(list(ranks), backend="gloo", timeout=timeout) for ranks in rank_sets}
