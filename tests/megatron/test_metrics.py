"""dhp's scalars from a plan, when a data iterator logs them, and Megatron's writers they go to; one process.

The 4-rank run that writes them to a real TensorBoard event file is `test_hooks_distributed.py`.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from megatron_dhp.closed_loop.scale_fit import TimeScales
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.step_metrics import StepMetrics, tokens_per_rank
from megatron_dhp.megatron.metrics import StepLog, Writers
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.workload.sample import Sample

SAMPLES = tuple(Sample(i, n) for i, n in enumerate((100, 60, 40, 30, 10)))


def mixed_plan() -> Plan:
    """Ranks 0, 1 share sample 0 at 3:1; rank 2 runs two microbatches, rank 3 (half speed) one of two samples."""
    groups = (PlanGroup((0, 1), ((0,),), shares=(3, 1)), PlanGroup((2,), ((1,), (2,))), PlanGroup((3,), ((3, 4),)))
    return Plan("hand", 4, 4, SAMPLES, groups, rank_speeds=(1.0, 1.0, 1.0, 0.5), predicted_step_time_s=0.3,
                lower_bound_s=0.25, solve_time_ms=4.5)


def one_group_plan() -> Plan:
    return Plan("hand", 4, 4, SAMPLES, (PlanGroup((0, 1, 2, 3), ((0, 1), (2, 3, 4))),))


def test_a_plans_scalars():
    mixed_plan().validate()
    values = StepMetrics().of(mixed_plan(), plan_wait_s=0.002)
    assert values == pytest.approx({
        "dhp/sequences": 5, "dhp/longest-sequence": 100, "dhp/microbatches": 4, "dhp/groups": 3, "dhp/phases": 1,
        "dhp/tokens-per-rank-max": 100, "dhp/tokens-per-rank-mean": 60,  # 75, 25, 100 and 40 tokens
        "dhp/groups-size-1": 2, "dhp/groups-size-2": 1,
        "dhp/step-time-predicted": 0.3, "dhp/lower-bound-time": 0.25, "dhp/step-vs-lower-bound": 1.2,
        "dhp/solve-ms": 4.5, "dhp/slow-ranks": 1, "dhp/slowest-rank-speed": 0.5, "dhp/rank-speed-3": 0.5,
        "dhp/plan-wait-ms": 2.0,
    })
    assert list(tokens_per_rank(mixed_plan())) == [75, 25, 100, 40]


def test_a_group_size_or_slow_rank_once_written_is_written_every_step():
    metrics = StepMetrics()
    metrics.of(mixed_plan())
    values = metrics.of(one_group_plan())
    assert (values["dhp/groups-size-1"], values["dhp/groups-size-2"], values["dhp/groups-size-4"]) == (0, 0, 1)
    assert (values["dhp/slow-ranks"], values["dhp/rank-speed-3"], values["dhp/slowest-rank-speed"]) == (0, 1.0, 1.0)
    assert "dhp/step-time-predicted" not in values and "dhp/solve-ms" not in values  # a hand plan has no timings
    assert "dhp/rank-speed-3" not in StepMetrics().of(one_group_plan())


def test_the_closed_loop_adds_the_last_measured_step_and_the_models_factors():
    loop = SimpleNamespace(adaptive=True, last_step=(0.30, 0.33), fit=SimpleNamespace(scales=TimeScales(1.1, 0.9)))
    values = StepMetrics().of(one_group_plan(), loop=loop)
    assert values["dhp/measured-step-time"] == pytest.approx(0.33)
    assert values["dhp/measured-step-time-predicted"] == pytest.approx(0.30)
    assert (values["dhp/model-attention-factor"], values["dhp/model-rest-factor"]) == pytest.approx((1.1, 0.9))
    loop.adaptive = False
    assert not any("measured" in name or "model" in name for name in StepMetrics().of(one_group_plan(), loop=loop))


def test_step_log_follows_megatrons_intervals_from_its_iteration():
    log = StepLog(prints=True, log_interval=3, writer_interval=2, iteration=9, writers=Writers(tensorboard=object()))
    due = []
    for _ in range(6):
        log.advance()
        due.append((log.iteration, log.line_due, log.scalars_due))
    assert due == [(10, False, True), (11, False, False), (12, True, True), (13, False, False), (14, False, True),
                   (15, True, False)]


@pytest.mark.parametrize("log", [StepLog(log_plans=False, prints=True), StepLog(prints=False)])
def test_no_plan_line_with_log_plans_off_or_off_rank_zero_and_no_scalars_without_a_writer(log):
    log.advance()
    assert not log.line_due and not log.scalars_due


def test_an_interval_below_one_is_refused():
    with pytest.raises(DhpError, match="log_interval 0 must be at least 1"):
        StepLog(log_interval=0)


class FakeTensorBoard:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_scalar(self, name, value, step):
        self.calls.append(("scalar", name, value, step))

    def add_text(self, name, text, step):
        self.calls.append(("text", name, text, step))


class FakeWandb:
    def __init__(self) -> None:
        self.logged: list[tuple] = []
        self.config = SimpleNamespace(update=lambda values, allow_val_change: self.logged.append(("config", values)))

    def log(self, values, step):
        self.logged.append(("log", values, step))


def test_writers_write_as_megatron_does():
    tb, wandb = FakeTensorBoard(), FakeWandb()
    log = StepLog(writers=Writers(tb, wandb), iteration=4)
    log.advance()
    log.write(one_group_plan())
    assert ("scalar", "dhp/sequences", 5.0, 5) in tb.calls and ("scalar", "dhp/groups-size-4", 1.0, 5) in tb.calls
    assert len(wandb.logged) == 1 and wandb.logged[0][2] == 5 and wandb.logged[0][1]["dhp/microbatches"] == 2
    Writers(tb, wandb).text("dhp/attention-backend", "attention backend sdpa", 0)
    assert tb.calls[-1] == ("text", "dhp/attention-backend", "attention backend sdpa", 0)
    assert wandb.logged[-1] == ("config", {"dhp/attention-backend": "attention backend sdpa"})


def test_megatron_lms_writers_are_found_where_it_keeps_them(monkeypatch):
    assert not Writers.of_megatron_lm()  # megatron-core alone: no megatron.training
    tb, wandb = object(), object()
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_tensorboard_writer, global_vars.get_wandb_writer = (lambda: tb), (lambda: wandb)
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    assert Writers.of_megatron_lm() == Writers(tb, wandb)
