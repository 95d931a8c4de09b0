"""The step plan: plain data shared by planners, the cost model and the runtime."""

from megatron_dhp.plan.pipeline import SlotRef, pipeline_slots, pipeline_token_cap, slot_tokens_per_rank
from megatron_dhp.plan.plan import SCHEMA, Plan, PlanError, PlanGroup

__all__ = ["SCHEMA", "Plan", "PlanError", "PlanGroup", "SlotRef", "pipeline_slots", "pipeline_token_cap",
           "slot_tokens_per_rank"]
