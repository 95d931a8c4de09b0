"""Helpers for the planner tests: a cost model on any domain, and planners with short MILP time limits."""

from __future__ import annotations

import pytest

from megatron_dhp.cost import build_cost_model
from megatron_dhp.solver import build_planner
from tests.configs import GPT7B

PEERS = ("megatron-hcp", "fcp-ref", "flexsp-milp")
TEST_TIME_LIMIT_S = 1.0


def model_for(world_size: int, gpus_per_node: int = 8, max_tokens_per_rank: int = 8192):
    """The gpt7b preset on another domain."""
    config = GPT7B.with_overrides(
        world_size=world_size, gpus_per_node=gpus_per_node, max_tokens_per_rank=max_tokens_per_rank
    )
    return build_cost_model(config)


@pytest.fixture(scope="session")
def planners():
    """One instance of each planner (megatron-core is imported once), MILPs capped at 1 s."""
    return {name: build_planner(name, {"time_limit_s": TEST_TIME_LIMIT_S}) for name in ("static", *PEERS)}
