"""One check shared by the tests of the cost model's optional keys: set explicitly to their defaults, they
change no plan, no number and no saved file."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from megatron_dhp.cost import CostConfig, build_cost_model
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.workload import LengthSource


def assert_defaults_change_nothing(reference: CostConfig, explicit: CostConfig, keys: Iterable[str], tmp_path: Path) -> None:
    """static and dhp plan a WLB-LLM batch identically under both configs, and `reference` saves without `keys`."""
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=256, seed=0, capacity=64 * 8192)
    for name in ("static", "dhp"):
        a = run_planner(build_planner(name), batch, build_cost_model(reference))
        b = run_planner(build_planner(name), batch, build_cost_model(explicit))
        assert a.predicted_step_time_s == b.predicted_step_time_s and a.lower_bound_s == b.lower_bound_s
    reference.save(tmp_path / "ref.yaml")
    text = (tmp_path / "ref.yaml").read_text()
    assert [key for key in keys if key in text] == []  # files stay as they were
    assert CostConfig.load(tmp_path / "ref.yaml") == reference
