"""The Megatron-LM hooks together on 4 gloo ranks, against the single-process oracle (fp32, relative 1e-5).

One launch runs everything (see `dist_workers.hooks_checks`): `setup` wraps Megatron-style loaders, the
schedule runs planned steps through Megatron's own forward/backward helpers and `finalize_model_grads`, and
`forward_step` feeds the model; loss and every gradient must equal a single process on the same documents. The
first run also logs as Megatron-LM does: dhp's scalars in a TensorBoard event file, the plan line, NVTX ranges.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dhp.launch.ranks import launch
from megatron_dhp.runtime.nvtx import METADATA, MOVE_TOKENS, PLAN_WAIT
from tests.megatron import dist_workers

K = dist_workers.LOADER_MICROBATCHES


@pytest.fixture(scope="module")
def tensorboard_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tensorboard")


@pytest.fixture(scope="module")
def ranks(tensorboard_dir) -> list[dict]:
    return launch(dist_workers.hooks_checks, 4, str(tensorboard_dir), timeout_s=500)


def assert_exact(result: dict, tolerance: float) -> None:
    assert result["dloss"] <= tolerance and result["dgrad"] <= tolerance, result


def test_iterators_are_planned_steps_inside_rerun_data_iterator(ranks):
    for r in ranks:
        assert r["wrapped"] == ("RerunDataIterator", "StepIterator", True)


def test_planned_steps_match_a_single_process(ranks):
    for r in ranks:
        assert len(r["exact"]) == 3
        for result in r["exact"]:
            assert_exact(result, r["tolerance"])


def test_each_rank_runs_the_plans_microbatch_count(ranks):
    # per step, the ranks' microbatch counts differ and are the plan's, not Megatron's K
    counts = [[c for c, _ in r["counts"]] for r in ranks]
    assert all(c >= 1 for rank in counts for c in rank)
    assert any(rank != [K] * 3 for rank in counts)


def test_the_group_family_is_created_at_setup_and_no_step_creates_a_group(ranks):
    for r in ranks:
        assert r["at_startup"] == 5  # dhp's family of 4 ranks: (0,1) (2,3) (0,1,2) (1,2,3) (0,1,2,3)
        assert [created for _, created in r["counts"]] == [0, 0, 0]


def test_planning_reads_one_step_ahead_and_a_replay_reads_nothing(ranks):
    for r in ranks:
        assert r["pulled_after_3"] == 4 * K  # 3 steps + the one planned ahead
        worst, extra_reads = r["replay"]
        assert worst == 0.0 and extra_reads == 0  # the same ops on the same rows in the same process: bitwise


def test_evaluation_runs_forward_only_through_the_plan(ranks):
    for r in ranks:
        assert_exact(r["eval"], r["tolerance"])


def test_barriers_between_phases_with_overlapped_gradient_reduction(ranks):
    for r in ranks:
        result, count = r["barrier"]
        assert_exact(result, r["tolerance"])
    assert [r["barrier"][1] for r in ranks][-1] == 2  # rank 3 ends in phase 0, before a barrier


def test_an_idle_rank_runs_one_empty_microbatch(ranks):
    for r in ranks:
        assert_exact(r["idle"][0], r["tolerance"])
    assert ranks[3]["idle"][1] == 1


def test_tensor_parallel_ranks_share_rank_zeros_loader(ranks):
    assert sorted(r["tp2_domain"] for r in ranks) == [(0, 2), (0, 2), (1, 3), (1, 3)]
    for r in ranks:
        for result in r["tp2"]:
            assert_exact(result, r["tolerance"])


def test_several_validation_sets_are_each_scored_on_their_own_data(ranks):
    # --multiple-validation-sets: a list of sets, not of model chunks; TP rank 1 was handed None for them
    for r in ranks:
        assert len(r["valid_sets"]) == len(dist_workers.VALIDATION_SETS)
        for result in r["valid_sets"]:
            assert_exact(result, r["tolerance"])


def test_pipeline_stages_run_the_plan_through_1f1b(ranks):
    # ranks 0, 1 are stage 0 and read the loader; 2, 3 are stage 1 and are sent the sequences
    assert [r["pp2_domain"] for r in ranks] == [((0, 1), True), ((0, 1), True), ((2, 3), False), ((2, 3), False)]
    for r in ranks:
        assert len(r["pp2"]) == 3  # two training steps and one evaluation step
        for result in r["pp2"]:
            assert_exact(result, r["tolerance"])


def test_sequence_parallel_pads_shards_to_the_tensor_parallel_size(ranks):
    for r in ranks:
        assert r["sp_multiple"] == 2
        for result in r["sp"]:
            assert_exact(result, r["tolerance"])


def test_moe_expert_parallel_ranks_run_aligned_slots(ranks):
    # rank 3 idle, then phases with barriers: EP partners run different microbatch counts (alltoall, then
    # allgather, whose slots also hold equal rows)
    for r in ranks:
        assert r["ep2_rules"] == {"alltoall": (True, False), "allgather": (True, True)}  # (aligned slots, equal rows)
        assert len(r["ep2"]) == 4
        for result in r["ep2"]:
            assert_exact(result, r["tolerance"])


def test_the_last_rank_writes_dhps_scalars_to_tensorboard_at_megatrons_iterations(ranks, tensorboard_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list(tensorboard_dir.iterdir())) == 1  # one event file: Megatron's writer is on the last rank only
    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()

    def scalars(name: str) -> dict[int, float]:
        return {e.step: e.value for e in events.Scalars(name)}

    # from iteration 9 (as resumed), every --tensorboard-log-interval 2: the first and third steps
    logged = {10: 0, 12: 2}
    assert sorted(scalars("dhp/sequences")) == sorted(logged)
    plans = ranks[-1]["plans"]
    sizes: set[int] = set()
    for iteration, step in logged.items():
        docs = [len(d.input_ids) for d in dist_workers.documents_of_step(step, 4)]  # the loader's, not the plan's
        assert scalars("dhp/sequences")[iteration] == len(docs)
        assert scalars("dhp/longest-sequence")[iteration] == max(docs)
        assert scalars("dhp/tokens-per-rank-mean")[iteration] == pytest.approx(sum(docs) / 4)
        plan = plans[step]
        assert scalars("dhp/microbatches")[iteration] == plan["microbatches"]
        assert scalars("dhp/step-time-predicted")[iteration] == pytest.approx(plan["predicted"], rel=1e-6)
        assert scalars("dhp/step-vs-lower-bound")[iteration] == pytest.approx(plan["predicted"] / plan["lower_bound"],
                                                                              rel=1e-6)
        assert scalars("dhp/solve-ms")[iteration] == pytest.approx(plan["solve_ms"], rel=1e-6)
        sizes |= {int(d) for d in plan["sizes"]}  # a size once written is written on, as 0 where absent
        written = {int(tag.rsplit("-", 1)[1]) for tag in events.Tags()["scalars"] if tag.startswith("dhp/groups-size-")
                   and iteration in scalars(tag)}
        assert written == sizes
        for d in sizes:
            assert scalars(f"dhp/groups-size-{d}")[iteration] == plan["sizes"].get(d, 0)
    # the closed loop has measured a step by the third (its report rides with a later length gather)
    assert sorted(scalars("dhp/measured-step-time")) == [12] and scalars("dhp/measured-step-time")[12] > 0
    assert "dhp/attention-backend/text_summary" in events.Tags()["tensors"]


def test_the_plan_line_follows_the_log_interval_on_rank_zero(ranks):
    # --log-interval 3 from iteration 9: the third step (12) only; evaluation counts its own steps (1: none)
    assert ranks[0]["lines"] == [0, 0, 1, 1]
    assert all(r["lines"] == [0, 0, 0, 0] for r in ranks[1:])


def test_each_step_marks_its_plan_wait_token_move_and_each_slots_metadata_as_nvtx_ranges(ranks):
    for r in ranks:
        for calls, (slots, _) in zip(r["ranges"], r["counts"], strict=True):
            assert calls == [PLAN_WAIT, "pop", MOVE_TOKENS, "pop", *[METADATA, "pop"] * slots]
