"""The closed loop (`megatron_dhp.closed_loop`): the speed estimator, the reports ranks make, the model the planner
gets, the slot clock and the fault injection around it."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_dhp.closed_loop import injection, slot_clock
from megatron_dhp.closed_loop.injection import InjectedSlowdown, timer_for_job
from megatron_dhp.closed_loop.loop import ClosedLoop, RankReport
from megatron_dhp.closed_loop.scale_fit import STATS, ScaleFit, TimeScales
from megatron_dhp.closed_loop.slot_clock import SlotClock
from megatron_dhp.closed_loop.speed_estimator import SpeedEstimator
from megatron_dhp.cost import ReferenceCostModel, build_cost_model, simulate
from megatron_dhp.cost.speeds import expand_speeds
from megatron_dhp.errors import DhpError
from megatron_dhp.integration import step_runtime
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.integration.job_spec import JobSpec
from megatron_dhp.integration.step_runtime import build_step_runtime
from megatron_dhp.launch.ranks import launch
from megatron_dhp.plan.rank_speeds import on_speed_grid, rank_speeds_text, slow_ranks, slow_ranks_text
from megatron_dhp.runtime.attention.comm import PeerRing
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.training.config import RunConfig, TrainConfig
from megatron_dhp.workload import LengthSource
from tests.configs import GPT7B
from tests.ranks import start_gloo_rank

BASE = GPT7B.with_overrides(world_size=16)
HALF = float(on_speed_grid(0.5))
"""A rank measured at half speed, as the loop publishes it: 1.02^-35, the speed grid's nearest point."""


def noisy(rng, truth, noise=0.05):
    return (np.asarray(truth) * rng.lognormal(0.0, noise, len(truth))).tolist()


def test_estimator_converges_on_synthetic_timings():
    rng = np.random.default_rng(0)
    truth = np.full(8, 3.0)  # the model is 3x too fast for this machine
    truth[3] = 6.0  # and rank 3 runs at half speed
    est = SpeedEstimator(8, window=5, hysteresis=0.1)
    for _ in range(8):
        estimate = est.update(noisy(rng, truth))
    assert estimate.time_scale == pytest.approx(3.0, rel=0.05)
    assert estimate.speeds[3] == pytest.approx(0.5, abs=0.05)
    assert all(v == 1.0 for r, v in enumerate(estimate.speeds) if r != 3)
    assert estimate.slow_ranks() == [(3, estimate.speeds[3])]


def test_estimator_ignores_one_outlier_step_and_gives_work_back_on_recovery():
    est = SpeedEstimator(4, window=5, hysteresis=0.1)
    for _ in range(5):
        est.update([1.0, 1.0, 2.0, 1.0])
    settled = est.estimate.speeds
    assert settled == (1.0, 1.0, HALF, 1.0)
    assert est.update([1.0, 3.0, 2.0, 1.0]).speeds == settled  # one slow step of rank 1: the median holds
    for _ in range(3):  # rank 2 recovers: once most of its window is fast again it is back at 1
        estimate = est.update([1.0, 1.0, 1.0, 1.0])
    assert estimate.speeds == (1.0, 1.0, 1.0, 1.0)


def test_noise_within_the_hysteresis_never_moves_a_speed():
    rng = np.random.default_rng(1)
    est = SpeedEstimator(16, window=3, hysteresis=0.1)
    for _ in range(30):
        assert est.update(noisy(rng, np.ones(16), noise=0.02)).speeds == (1.0,) * 16


def test_missing_reports_keep_what_was_known():
    est = SpeedEstimator(3, initial=(1.0, 0.5, 1.0))
    assert est.update([float("nan")] * 3).speeds == (1.0, 0.5, 1.0)
    assert est.update([1.0, 9.0, 1.0]).speeds == (1.0, 0.5, 1.0)  # a rank's first reports estimate nothing alone
    with pytest.raises(DhpError, match="2 speed reports for a domain of 3 ranks"):
        est.update([1.0, 1.0])



@pytest.mark.parametrize("measured", [0.45, 0.47, 0.5, 0.62, 0.7, 0.83])
def test_the_loop_publishes_speeds_on_the_grid_the_bounds_price_on(measured):
    # One grid: a published speed is a level of the bounds as it is (they round up only what is off the grid).
    est = SpeedEstimator(2)
    for _ in range(3):
        published = est.update([1.0, 1.0 / measured]).speeds[1]
    assert published == float(on_speed_grid(measured)) and abs(published / measured - 1) <= 0.01
    levels = GPT7B.with_overrides(world_size=2, rank_speeds=(1.0, published)).domain.speed_levels()
    assert levels == [(1.0, 1, 1), (published, 2, 2)]


@pytest.mark.parametrize("speeds, slow", [
    ((1.0,) * 14 + (0.95, 0.5), [15]),  # 0.95 is within 0.9 of the fastest: not slow anywhere
    ((2.0,) * 14 + (1.9, 1.0), [15]),  # stated speeds above 1: 1.0 is slow beside 2.0
    ((1.0,) * 16, []),
])
def test_one_rule_and_one_wording_name_a_slow_rank_in_the_plan_the_estimate_and_the_loop(speeds, slow):
    expected = [(r, speeds[r]) for r in slow]
    plan = plan_of(build_cost_model(BASE.with_overrides(rank_speeds=speeds)))
    loop = ClosedLoop(BASE, adaptive=False, stated=speeds)
    assert slow_ranks(speeds) == plan.slow_ranks() == loop.estimate.slow_ranks() == expected
    text = slow_ranks_text(speeds)
    assert text == (f"slow {rank_speeds_text(expected)}" if slow else "")
    assert (text in plan.summary() and f"closed loop: {text} |" in loop.summary()) if slow else (
        "slow" not in plan.summary() and "closed loop: no slow ranks |" in loop.summary())

def plan_of(model, size=64, index=0):
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=size, seed=0, index=index, capacity=model.domain.capacity)
    return run_planner(build_planner("dhp"), batch, model)


def test_report_is_measured_over_predicted_of_the_ranks_fastest_group():
    loop = ClosedLoop(BASE)
    plan = plan_of(build_cost_model(BASE), size=256)
    timeline = simulate(plan, build_cost_model(BASE))
    position = max(range(16), key=lambda r: len(plan.groups_of_rank(r)))
    slots, factors = [], {}
    for span in timeline.spans:
        group = plan.groups[span.group_index]
        if position in group.ranks:
            factors[span.group_index] = (2.0 if span.group_index % 2 else 3.0, sum(span.microbatch_s))
            slots += [(mb, factors[span.group_index][0] * s) for mb, s in zip(group.microbatches, span.microbatch_s)]
    assert len(factors) >= 2
    total = sum(p for _, p in factors.values())
    expected = min(f for f, p in factors.values() if p >= 0.1 * total)
    rho, span, step, *stats = loop.report(plan, position, slots + [((-1,), 5.0)], 42.0)  # idle slot: no sample
    assert rho == pytest.approx(expected) and step == pytest.approx(plan.predicted_step_time_s) and span == 42.0
    assert len(stats) == STATS and stats[0] + stats[2] > 0
    assert loop.report(plan, position, [], 0.0) == ()


def test_a_report_travels_as_its_width_of_floats_and_reads_back():
    # The width the length gather carries was a constant (8) in the runtime that had to equal 3 + STATS here.
    report = RankReport(0.5, 2.0, 1.5, tuple(float(k) for k in range(STATS)))
    assert len(report.floats()) == RankReport.WIDTH == ClosedLoop(BASE).width == 3 + STATS
    assert RankReport.read(report.floats()) == report
    assert RankReport.read((math.nan,) * RankReport.WIDTH) is None and RankReport.read((0.7,)) is None
    assert RankReport.ratio_in((0.7,)) == 0.7 and math.isnan(RankReport.ratio_in(()))



def test_the_loop_asks_the_cost_model_for_each_slots_attention(monkeypatch):
    # A slot's attention seconds come from `CostModel.attention_time`, not from the coefficients: a model that
    # prices no attention leaves the fit's attention statistics at 0, one that prices half as much quarters A^2.
    plan = plan_of(build_cost_model(BASE), size=256)
    position = max(range(16), key=lambda r: len(plan.groups_of_rank(r)))
    timeline = simulate(plan, build_cost_model(BASE))
    slots = [(mb, s) for span in timeline.spans if position in plan.groups[span.group_index].ranks
             for mb, s in zip(plan.groups[span.group_index].microbatches, span.microbatch_s)]
    asked = ReferenceCostModel.attention_time
    _, _, _, aa, ar, rr, ay, _ = ClosedLoop(BASE).report(plan, position, slots, 1.0)
    assert aa > 0 and ay > 0
    monkeypatch.setattr(ReferenceCostModel, "attention_time", lambda self, samples, d: np.zeros(len(samples)))
    none = ClosedLoop(BASE).report(plan, position, slots, 1.0)
    assert none[3] == none[4] == none[6] == 0 and none[5] > rr
    monkeypatch.setattr(ReferenceCostModel, "attention_time", lambda self, samples, d: 0.5 * asked(self, samples, d))
    assert ClosedLoop(BASE).report(plan, position, slots, 1.0)[3] == pytest.approx(aa / 4)

def test_sigma_is_the_slowest_spans_excess_over_the_plans_step():
    loop = ClosedLoop(BASE)
    for excess in (9.0, 0.3, 0.3, 5.0):  # the first timed step runs cold; one outlier step moves no median
        loop.observe([(1.0, 10.0 + excess, 10.0, 1.0, 0.0, 1.0, 1.0, 1.0)] + [(1.0, 9.0, 10.0, 1.0, 0.0, 1.0, 1.0, 1.0)] * 15)
    assert loop.model().step_overhead_s == pytest.approx(0.3)
    assert "pred 10.300s meas 15.000s" in loop.summary()
    # the slots take 3x their prediction: the factors jump, and excesses measured against the old model go
    loop.observe([(1.0, 12.0, 10.0, 1.0, 0.0, 1.0, 3.0, 3.0)] * 16)
    assert loop.fit.scales.rest > 1.2 and loop.model().step_overhead_s == pytest.approx(2.0)


def test_every_rank_derives_the_same_plan_from_the_same_reports():
    loops = [ClosedLoop(BASE), ClosedLoop(BASE)]
    stats = (1.0, 0.0, 1.0, 1.2, 1.2)  # y = 1.2 A + 1.2 R, and twice that on the half-speed rank 15
    reports = [(1.2, 1.0, 1.0, *stats)] * 15 + [(2.4, 1.0, 1.0, 1.0, 0.0, 1.0, 2.4, 2.4)]
    for _ in range(4):
        for loop in loops:
            loop.observe(reports)
    a, b = (plan_of(loop.model()) for loop in loops)
    assert a.fingerprint() == b.fingerprint() and a.rank_speeds == b.rank_speeds
    assert a.rank_speeds[15] == HALF and loops[0].fit.scales == TimeScales(1.2, 1.2)
    assert "closed loop: slow r15@0.50 |" in loops[0].summary() and "pred 1.000s meas 1.000s" in loops[0].summary()
    assert "| slow r15@0.50 |" in a.summary()  # the plan's line names it with the same words


def test_the_loops_model_is_the_configured_one_with_its_fitted_factors():
    loop = ClosedLoop(BASE)
    plan = plan_of(build_cost_model(BASE))
    for _ in range(4):  # every rank's slots say y = 2 A + 3 R (the first step runs cold)
        loop.observe([(2.5, 0.0, 0.0, 4.0, 1.0, 2.0, 4.0 * 2 + 1.0 * 3, 1.0 * 2 + 2.0 * 3)] * 16)
    assert loop.fit.scales == TimeScales(pytest.approx(2.0), pytest.approx(3.0))
    assert loop.model().domain.nominal  # a uniform slowdown is no rank's
    expected = simulate(plan, build_cost_model(BASE.scaled(3.0, attention=2.0))).step_time_s
    assert simulate(plan, loop.model()).step_time_s == pytest.approx(expected, rel=1e-6)
    off = ClosedLoop(BASE, adaptive=False, stated=(1.0,) * 15 + (0.5,))
    off.observe([(2.0, 0.0, 0.0, 1.0, 0.0, 1.0, 2.0, 2.0)] * 16)
    assert off.fit.scales == TimeScales() and off.model().domain.rank_speeds[15] == 0.5


def test_plans_use_published_speeds_and_predictions_the_measured_ones():
    # Rank 15 measured 2.1x as slow: plans see it at the published 1.02^-37 = 0.481 (the speed grid's nearest
    # point, held by the hysteresis so they stay steady), the step's prediction at 1 / 2.1 (what was measured).
    loop = ClosedLoop(BASE)
    for _ in range(3):
        loop.observe([(1.0,)] * 15 + [(2.1,)])
    assert loop.model().domain.rank_speeds[15] == pytest.approx(1.02 ** -37, rel=1e-12)
    assert loop.predictor().domain.rank_speeds[15] == pytest.approx(1 / 2.1, rel=1e-5)
    assert loop.model() is loop.model() and loop.predictor() is not loop.model()


def test_scale_fit_falls_back_to_one_factor_and_holds_within_its_step():
    fit = ScaleFit(window=3)
    assert fit.update([1.0, 2.0, 4.0, 4.5, 9.0]) == TimeScales(1.5, 1.5)  # R = 2 A: one factor, y = 1.5 (A + R)
    assert fit.update([1.0, 2.0, 4.0, 4.52, 9.04]).attention == 1.5  # moved < 2 %: not republished
    assert fit.update([float("nan")] * 5) == fit.scales


def test_a_slow_rank_leaves_the_fit_with_its_earlier_steps_once_it_is_known():
    # Rank 3 of 4 runs at half speed from the start: its slots measure y = 2 (2 A + 3 R), the others' 2 A + 3 R.
    # Until the estimator knows (its third report), the fit sees inflated factors; from then on every step in
    # the window, those before included, is fitted without rank 3: the fit is the truth at once.
    a, r = np.array([4.0, 1.0, 9.0, 2.0]), np.array([1.0, 2.0, 1.0, 3.0])
    row = lambda f: [a @ a, a @ r, r @ r, a @ (f * (2 * a + 3 * r)), r @ (f * (2 * a + 3 * r))]  # noqa: E731
    loop = ClosedLoop(BASE.with_overrides(world_size=4))
    for step in range(3):  # (the first timed step runs cold and fits nothing)
        loop.observe([(1.0, 1.0, 1.0, *row(1.0))] * 3 + [(2.0, 1.0, 1.0, *row(2.0))])
        if step == 1:
            assert loop.fit.scales.rest > 3.5  # rank 3 still counted at speed 1
    assert loop.estimate.speeds == (1.0, 1.0, 1.0, HALF)
    assert loop.fit.scales == TimeScales(pytest.approx(2.0), pytest.approx(3.0))


class StoppedClock:
    """`time` for the clock and the injection: it reads `now`, which only a sleep moves, so a slot's seconds
    are what the code makes them, on any machine under any load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_slot_timer_holds_an_injected_slot_longer_and_hands_each_step_over_once(monkeypatch):
    clock = StoppedClock()
    monkeypatch.setattr(slot_clock, "time", clock)
    monkeypatch.setattr(injection, "time", clock)
    timer = InjectedSlowdown(SlotClock(torch.device("cpu")), slowdown=3.0, hold=False)
    with timer.slot((4, 7)):
        clock.sleep(0.25)  # the slot's own work
    timer.end_step("plan")
    tag, slots, span = timer.take()
    assert tag == "plan" and slots == [((4, 7), 0.75)] and span == 0.75  # then held twice as long again
    assert timer.take() is None



class Untouchable:
    """A group whose every use fails: a timer that only measures never asks it anything."""

    def __getattr__(self, name):
        raise AssertionError(f"the production clock used the group's {name}")


def test_the_production_clock_only_measures_and_injection_is_put_on_only_when_slow_ranks_are_set(monkeypatch):
    clock = timer_for_job(torch.device("cpu"), {})
    assert type(clock) is SlotClock
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("the production clock slept"))
    with clock.slot((3,), Untouchable()):
        pass
    clock.end_step("plan")
    assert clock.take()[0] == "plan"
    with pytest.raises(TypeError):
        SlotClock(torch.device("cpu"), slowdown=2.0)  # no injection knob on the production path
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    slowed, holding = timer_for_job(torch.device("cpu"), {1: 3.0}), timer_for_job(torch.device("cpu"), {0: 3.0})
    assert isinstance(slowed, InjectedSlowdown) and type(slowed.clock) is SlotClock
    assert (slowed.slowdown, slowed.hold) == (3.0, True) and (holding.slowdown, holding.hold) == (1.0, True)


WORK_S = 0.05
CLOSED = "rank {}'s clock closed the slot"
WAITED = "rank 1's injected wait ended"


def _log(path: str, event: str) -> None:
    with open(path, "a") as f:  # one short append: the file holds the events in the order they happened
        f.write(event + "\n")


def _events(path: str) -> list[str]:
    return Path(path).read_text().splitlines() if Path(path).exists() else []


def injected_slot_events(hold: bool, ring: bool, log: str) -> None:
    """One slot of a two-rank group, rank 1 injected 3x (a `launch` worker); the ranks log to `log` when rank 1's
    injected wait ends and when each rank's clock closes the slot (its second reading). With `hold` that wait
    lasts its injected length; without, until rank 0's clock has closed (60 s at most, a hang guard). Either
    order the test reads is then forced by the code, not by the machine's load."""
    start_gloo_rank()
    rank, readings = dist.get_rank(), []

    def read() -> float:
        readings.append(time.perf_counter())
        if len(readings) == 2:
            _log(log, CLOSED.format(rank))
        return readings[-1]

    def wait(seconds: float) -> None:
        deadline = time.monotonic() + (seconds if hold else 60.0)
        while time.monotonic() < deadline and CLOSED.format(0) not in _events(log):
            time.sleep(0.005)
        _log(log, WAITED)

    group = dist.new_group([0, 1])
    timer = InjectedSlowdown(SlotClock(torch.device("cpu")), slowdown=3.0 if rank == 1 else 1.0, hold=hold)
    with mock.patch.object(slot_clock, "time", SimpleNamespace(perf_counter=read)), \
            mock.patch.object(injection, "time", SimpleNamespace(perf_counter=time.perf_counter, sleep=wait)):
        with timer.slot((0,), PeerRing.of_group(group) if ring else group):
            time.sleep(WORK_S)
    dist.barrier()


@pytest.mark.parametrize("ring", [False, True], ids=["group", "peer-ring"])
def test_an_injected_rank_holds_its_group_until_its_wait_ends(ring, tmp_path):
    # With the hold, rank 0's clock closes the group's slot only after rank 1's injected wait has ended (a
    # throttled GPU holds its group inside the collectives, and the fast rank's seconds must show it); without
    # it, rank 0 leaves while rank 1 still waits. The order of the ranks' events says which, not their times.
    for hold in (True, False):
        log = tmp_path / f"hold_{hold}.log"
        launch(injected_slot_events, 2, hold, ring, str(log), timeout_s=120)
        events = _events(str(log))
        assert sorted(events) == sorted([CLOSED.format(0), CLOSED.format(1), WAITED]), events
        assert (events.index(WAITED) < events.index(CLOSED.format(0))) == hold, (hold, events)
        assert events.index(WAITED) < events.index(CLOSED.format(1)), events  # rank 1 measures its own wait


@pytest.mark.parametrize("overrides, message", [
    ({"slow_ranks": ("1",)}, "slow rank '1' must be RANK:FACTOR"),
    ({"slow_ranks": ("1:0.5",)}, "the factor >= 1.0"),
    ({"rank_speeds": (1.0,), "node_speeds": (1.0,)}, "rank_speeds or node_speeds, not both"),
    ({"adaptive_window": 0}, "adaptive_window = 0 must be at least 1"),
    ({"adaptive_hysteresis": 1.5}, "adaptive_hysteresis = 1.5 must be in"),
])
def test_bad_closed_loop_settings_are_clear_errors(overrides, message):
    with pytest.raises(DhpError, match=message):
        DhpConfig(**overrides)


def test_node_speeds_expand_to_ranks():
    assert expand_speeds((), (1.0, 0.45), 4, 2) == (1.0, 1.0, 0.45, 0.45)
    with pytest.raises(DhpError, match="node_speeds holds 1 speeds but the domain of 4 ranks spans 2 nodes"):
        expand_speeds((), (1.0,), 4, 2)


def test_scale_fit_leaves_out_ranks_not_counted_and_falls_back_when_none_timed():
    # Rank 1's seconds say 3x (a noisy slow rank); counted, it drags the factors; left out, rank 0's 2x stands.
    a, r = np.array([4.0, 1.0]), np.array([1.0, 2.0])
    row = lambda f: [a @ a, a @ r, r @ r, a @ (f * (a + r)), r @ (f * (a + r))]  # noqa: E731
    assert ScaleFit().update([row(2.0), row(3.0)]) == TimeScales(2.5, 2.5)
    assert ScaleFit().update([row(2.0), row(3.0)], counted=[True, False]) == TimeScales(2.0, 2.0)
    assert ScaleFit().update([[0.0] * 5, row(3.0)], counted=[True, False]) == TimeScales(3.0, 3.0)


def test_scale_fit_takes_one_factor_where_two_would_split_tenfold():
    # Attention a sliver of each slot (short rows) and 2 % noise on one: two factors would put attention at 27x.
    a, r = np.array([1e-3, 2e-3, 1e-3]), np.array([1.0, 1.0, 2.0])
    y = 2.0 * (a + r) * np.array([1.0, 1.02, 1.0])
    stats = [a @ a, a @ r, r @ r, a @ y, r @ y]
    det = stats[0] * stats[2] - stats[1] ** 2
    assert (stats[3] * stats[2] - stats[4] * stats[1]) / det > 20  # what the two-factor solve gives
    fit = ScaleFit().update(stats)
    assert fit.attention == fit.rest == pytest.approx(2.0, rel=0.01)


# ---------------------------------------------------------------------- under pipeline parallelism: off, and said
UNTIMED = "megatron-core's 1F1B runs the slots under pipeline parallelism, and megatron-dhp does not time them"


@pytest.mark.parametrize("build, message", [
    (lambda: JobSpec(DhpConfig(slow_ranks=("1:2.0",)), 4, 4, pipeline_stages=2),
     "slow_ranks 1:2.0 with pipeline_stages 2: "),
    (lambda: TrainConfig(train=RunConfig(pp=2, nproc=4), dhp=DhpConfig(slow_ranks=("1:2.0", "3:1.5"))),
     "dhp.slow_ranks 1:2.0 3:1.5 with train.pp 2: "),
])
def test_fault_injection_under_pipeline_parallelism_is_refused_in_one_line(build, message):
    with pytest.raises(DhpError) as e:
        build()
    assert str(e.value).startswith(message + UNTIMED) and "\n" not in str(e.value)
    assert JobSpec(DhpConfig(slow_ranks=("1:2.0",)), 4, 4).config.slowdowns == {1: 2.0}  # without PP: injected


def test_under_pipeline_parallelism_the_loop_is_off_times_nothing_and_says_why_at_start_up(monkeypatch, caplog):
    monkeypatch.setattr(step_runtime, "GroupPool", lambda domain, **kw: SimpleNamespace(family=kw["family"]))
    monkeypatch.setattr(step_runtime, "kernels_status", lambda device: "kernels")
    monkeypatch.setattr(step_runtime.dist, "get_rank", lambda: 0)
    domain = SimpleNamespace(device=torch.device("cpu"))
    for adaptive in (True, False):
        for stages in (1, 2):
            spec = JobSpec(DhpConfig(adaptive=adaptive), 4, 4, pipeline_stages=stages)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger=step_runtime.__name__):
                runtime = build_step_runtime(spec, domain, dataset_max_tokens=None)
            loop, engine = runtime.planner.loop, runtime.engine()
            runs = adaptive and stages == 1
            assert loop.adaptive is runs and (engine.timer is not None) is runs and (engine.feedback is loop) is runs
            said = [r.getMessage() for r in caplog.records if "adaptive is off" in r.getMessage()]
            assert said == ([f"dhp: adaptive is off under pipeline parallelism (2 stages): {UNTIMED}, so plans use "
                             "the stated speeds and the configured cost model"] if adaptive and stages == 2 else [])
    # and an off loop learns nothing from what it is shown
    loop = ClosedLoop(BASE, pipeline_stages=2)
    loop.observe([(2.0, 1.0, 1.0, 1.0, 0.0, 1.0, 2.0, 2.0)] * 16)
    assert loop.estimate.steps == 0 and loop.fit.scales == TimeScales()
