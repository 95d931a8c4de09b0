"""bench/straggler_sim.py on a tiny domain: every scenario and planner recorded, speed-aware dhp ahead on one-0.5."""

from __future__ import annotations

import json

import numpy as np

from tests.bench_scripts import load_bench

straggler_sim = load_bench("straggler_sim")


def test_tiny_run_records_every_scenario_and_planner(tmp_path):
    out = tmp_path / "records.json"
    straggler_sim.main(["--sizes", "64x16", "--batches", "1", "--drift-steps", "3", "--drift-steps-large", "3",
                        "--json", str(out)])
    data = json.loads(out.read_text())
    records = data["records"]
    seen = {(r["scenario"], r["planner"]) for r in records}
    for scenario in straggler_sim.SCENARIOS:
        for planner in straggler_sim.PLANNERS:
            assert (scenario, planner) in seen, (scenario, planner)
    assert {r["batch"] for r in records if r["scenario"] == "drift"} == {0, 1, 2}
    assert ("drift", straggler_sim.NOLAG) in seen
    step = {(r["scenario"], r["batch"], r["planner"]): r["step_s"] for r in records}
    assert step[("one-0.5", 0, "dhp")] <= step[("one-0.5", 0, "dhp-blind")] * (1 + 1e-9)
    assert step[("nominal", 0, "dhp")] == step[("nominal", 0, "dhp-blind")]
    for r in records:  # the bound holds under the true speeds, lag or not
        if r["step_s"] is not None:
            assert r["lb_s"] <= r["step_s"] * (1 + 1e-9), r
    assert [t["met"] for t in data["targets"]][1] is None  # no 64-rank cell in this run


def test_scenarios_slow_the_ranks_they_name():
    assert np.flatnonzero(straggler_sim.fixed_speeds("one-0.5", 64, 8, 0) < 1).tolist() == [21]
    assert np.flatnonzero(straggler_sim.fixed_speeds("node-0.7", 64, 8, 0) < 1).tolist() == list(range(8, 16))
    assert (straggler_sim.fixed_speeds("1pct-0.5", 1024, 8, 0) == 0.5).sum() == 10
    assert (straggler_sim.fixed_speeds("two-gen", 64, 8, 0)[32:] == 0.45).all()
    trace = straggler_sim.drift_trace(64, 40, 0)
    assert trace.shape == (41, 64) and trace.min() >= 0.4 and trace.max() <= 1.0
    assert (trace[10:20] <= 0.5).any(axis=0).sum() >= 2  # the two dips


def test_drift_plans_from_the_steps_up_to_lead_before():
    """Under read-ahead (lead 2) a step is planned from the reports one step older than without (lead 1): a
    step change at step 10, with no trend to carry, reaches the plans one step later."""
    trace = np.ones((20, 4))
    trace[10:, 1] = 0.5
    one, two = straggler_sim.predicted(trace, 1), straggler_sim.predicted(trace, 2)
    assert (two[0] == 1.0).all() and (two[1] == 1.0).all() and (one[0] == 1.0).all()
    np.testing.assert_array_equal(two[2:], one[1:-1])
    assert one[12, 1] == 0.5 and two[12, 1] == 1.0 and two[13, 1] == 0.5  # the median of 5 moves at the 3rd


def test_the_fluid_floor_is_what_lagged_speeds_cost_a_perfectly_balanced_plan():
    """Two ranks planned at 1.0 each take half of 2 s of work; the second runs at 0.5 and ends at 2 s, where
    work spread by the true speeds ends at 2 / 1.5 s: 1.5x. Known speeds cost nothing."""
    assert straggler_sim.fluid_floor(np.array([1.0, 1.0]), np.array([1.0, 0.5])) == 1.5
    speeds = np.array([0.4, 0.7, 1.0])
    assert straggler_sim.fluid_floor(speeds, speeds) == 1.0
