"""Planners: each maps a batch and a cost model to the groups of one step.

`PLANNERS` maps a planner's name to its class. `build_planner` constructs one from two kinds of input:
options, which must be ones the planner takes (a typo is an error, never silently dropped), and a
`PlannerContext` of facts about the job that callers hand every planner alike, each planner reading the
facts its constructor names.
"""

from __future__ import annotations

import inspect
from typing import TypedDict

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.comm import DEFAULT_COMMUNICATOR_MB, CommPolicy
from megatron_dhp.solver.base import Planner, PlannerUnsupported, run_planner
from megatron_dhp.solver.dhp import DhpPlanner
from megatron_dhp.solver.fcp_ref import FCPRefPlanner
from megatron_dhp.solver.flexsp_milp import FlexSPPlanner
from megatron_dhp.solver.megatron_hcp import MegatronHCPPlanner
from megatron_dhp.solver.static import StaticPlanner, static_cp_size

PLANNERS: dict[str, type] = {
    "dhp": DhpPlanner,
    "static": StaticPlanner,
    "megatron-hcp": MegatronHCPPlanner,
    "fcp-ref": FCPRefPlanner,
    "flexsp-milp": FlexSPPlanner,
}


class PlannerContext(TypedDict, total=False):
    """Facts about the job, the same for every planner; a planner reads those its constructor names.

    A key left out keeps each planner's own default.
    """

    dataset_max_tokens: int | None
    """The dataset's longest sample (static sizes its one CP by it, so no later batch outgrows the groups)."""
    time_limit_s: float
    """Time limit of each solver call (flexsp-milp's MILPs)."""


def planner_class(name: str) -> type[Planner]:
    """The registered planner `name`, or a `DhpError` when it is unknown or does not declare its traits."""
    if name not in PLANNERS:
        raise DhpError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")
    if Planner not in PLANNERS[name].__mro__:
        raise DhpError(f"planner {name!r} ({PLANNERS[name].__name__}) must subclass megatron_dhp.solver.Planner, "
                       "which declares the traits every planner has")
    return PLANNERS[name]


def planner_options(name: str) -> list[str]:
    """The options planner `name` takes (its constructor's parameters but `name`)."""
    return [p for p in inspect.signature(PLANNERS[name]).parameters if p != "name"]


def planner_comm_policy(name: str, comm: str, *, world_size: int, gpus_per_node: int,
                        max_groups_per_rank: int | None = None, layer_spec: str = "local",
                        communicator_mb: float = DEFAULT_COMMUNICATOR_MB) -> CommPolicy:
    """The comm policy planner `name` plans under (`CommPolicy.resolve`): left unset, its family bound follows
    the planner's `plans_on_family` (dhp keeps to the default family, a peer plans as published)."""
    return CommPolicy.resolve(comm, layer_spec=layer_spec, max_groups_per_rank=max_groups_per_rank,
                              keeps_to_family=planner_class(name).plans_on_family, world_size=world_size,
                              gpus_per_node=gpus_per_node, communicator_mb=communicator_mb)


def build_planner(name: str, context: PlannerContext | None = None, **options: object) -> Planner:
    """The planner `name` with `options` and whichever `context` facts it reads.

    An option the planner does not take, or a context key that is not a `PlannerContext` fact, is a
    `DhpError` naming it and what is accepted.
    """
    cls = planner_class(name)
    accepted = planner_options(name)
    for key in options:
        if key not in accepted:
            takes = f"it accepts {', '.join(accepted)}" if accepted else "it takes no options"
            raise DhpError(f"planner {name!r} has no option {key!r}; {takes}")
    context = context or {}
    for key in context:
        if key not in PlannerContext.__annotations__:
            raise DhpError(f"planner context has no key {key!r}; it holds {', '.join(PlannerContext.__annotations__)}")
    facts = {k: v for k, v in context.items() if k in accepted}
    return cls(**{**facts, **options})


__all__ = [
    "PLANNERS",
    "DhpPlanner",
    "FCPRefPlanner",
    "FlexSPPlanner",
    "MegatronHCPPlanner",
    "Planner",
    "PlannerContext",
    "PlannerUnsupported",
    "StaticPlanner",
    "build_planner",
    "planner_comm_policy",
    "run_planner",
    "static_cp_size",
]
