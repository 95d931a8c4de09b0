"""Shared fixtures: the preset cost model and small helpers to build plans by hand."""

from __future__ import annotations

import pytest

from megatron_dhp.cost import CostConfig, build_cost_model


@pytest.fixture(scope="session")
def gpt7b_config() -> CostConfig:
    return CostConfig.load("gpt7b-64")


@pytest.fixture(scope="session")
def gpt7b(gpt7b_config):
    return build_cost_model(gpt7b_config)
