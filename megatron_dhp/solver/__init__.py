"""Planners: each maps a batch and a cost model to the groups of one step.

`PLANNERS` maps a planner's name to its class; `build_planner` constructs one with only the options it
accepts, so callers can hand every planner the same context (e.g. the dataset's longest sample).
"""

from __future__ import annotations

import inspect

from megatron_dhp.errors import DhpError
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


def build_planner(name: str, **context: object) -> Planner:
    """The planner `name`, given whichever of `context`'s options its constructor takes."""
    if name not in PLANNERS:
        raise DhpError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")
    cls = PLANNERS[name]
    accepted = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in context.items() if k in accepted and k != "name"})


__all__ = [
    "PLANNERS",
    "DhpPlanner",
    "FCPRefPlanner",
    "FlexSPPlanner",
    "MegatronHCPPlanner",
    "Planner",
    "PlannerUnsupported",
    "StaticPlanner",
    "build_planner",
    "run_planner",
    "static_cp_size",
]
