"""The `dhp` planner: cells, wide groups placed skyline-style, LPT fill and local moves."""

from megatron_dhp.solver.dhp.planner import DhpPlanner

__all__ = ["DhpPlanner"]
