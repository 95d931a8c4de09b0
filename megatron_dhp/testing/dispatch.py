"""One step's token move alone, for tests that look only at the moved tokens."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.engine import PlanSource, StepEngine
from megatron_dhp.runtime.step_data import StepInputs, TokenSample


def dispatch(local: Sequence[TokenSample], domain: DynamicDomain, *, plan: Plan | None = None,
             planner: PlanSource | None = None) -> StepInputs:
    """This rank's inputs of one step (given plan, or planned by `planner` on rank 0), creating no groups: an
    engine without a pool or comm policy only moves tokens. Collective."""
    if (plan is None) == (planner is None):
        raise DhpError("dispatch needs exactly one of plan= or planner=")
    return StepEngine(domain, planning=planner).prepare(local, plan)
