"""PP 2 through megatron-core's own 1F1B with dynamic groups, against the single-process oracle (gloo, CPU).

One launch of 4 ranks (two stages, domains of 2) shares its start-up across the checks; the deadline turns
a hang (a deadlock of the schedule) into a failure.
"""

from __future__ import annotations

import pytest

from megatron_dhp.launch.ranks import LaunchError, launch
from megatron_dhp.plan.pipeline import pipeline_slots
from tests.numerics import RELATIVE
from tests.runtime import dist_workers, pipeline_workers


@pytest.fixture(scope="module")
def pp2() -> list[dict]:
    return launch(pipeline_workers.pipeline_two_checks, 4, timeout_s=300)


def test_the_plans_cover_idle_slots_uneven_counts_and_the_naive_deadlock():
    slots = {name: pipeline_slots(plan) for name, plan in pipeline_workers.plans_of_two().items()}
    naive = slots["naive deadlock [g, h] vs [g, b1, h]"]
    assert naive[0][1] is None and naive[1][1] is not None  # position 0 waits one idle slot for h
    uneven = slots["idle slot, then 2 vs 4 slots in the last phase"]
    assert [len(row) for row in uneven] == [7, 5] and uneven[1][1] is None


def test_domains_are_the_pipeline_stages(pp2):
    assert [r["domain"] for r in pp2] == [(0, 1), (0, 1), (2, 3), (2, 3)]


@pytest.mark.parametrize("key", [(name, comm) for name in pipeline_workers.plans_of_two()
                                 for comm in pipeline_workers.comms_of(name)])
def test_pp2_loss_and_every_gradient_match_single_process(pp2, key):
    for rank in pp2:  # each stage compares its own parameters (the tied output layer on the last stage)
        result = rank["exact"][key]
        assert result.max_loss_diff <= RELATIVE and result.max_grad_diff <= RELATIVE, result
        assert result.tokens_computed == result.batch_tokens == sum(dist_workers.LENGTHS), result
        assert result.loss_tokens_computed == result.batch_loss_tokens, result
        assert result.ok


@pytest.mark.parametrize("name", list(pipeline_workers.plans_of_two()))
def test_pp2_tied_embeddings_match_single_process(pp2, name):
    for rank in pp2:  # stage 0's embedding and stage 1's output layer both hold the whole shared gradient
        assert rank["tied"][name].ok, rank["tied"][name]


def test_stages_with_different_plans_stop_every_rank_with_a_clear_error(pp2):
    for rank in pp2:  # the last stage's rank 3 holds the other plan
        assert rank["divergent"].startswith("ranks hold different plans: rank")
        assert ("ranks [3]" if rank["rank"] != 3 else "ranks [0, 1, 2]") in rank["divergent"]
    assert all(rank["after_errors"].ok for rank in pp2)


@pytest.fixture(scope="module")
def pp2_domain3() -> list[dict]:
    return launch(pipeline_workers.pipeline_three_checks, 6, timeout_s=400)


def test_pp2_with_a_domain_of_three_matches_single_process(pp2_domain3):
    assert [r["domain"] for r in pp2_domain3] == [(0, 1, 2)] * 3 + [(3, 4, 5)] * 3
    for rank in pp2_domain3:
        for key, result in rank["exact"].items():
            assert result.ok and result.tokens_computed == sum(dist_workers.LENGTHS), (key, result)


@pytest.fixture(scope="module")
def vpp2() -> list[dict]:
    return launch(pipeline_workers.interleaved_checks, 4, timeout_s=400)


@pytest.mark.parametrize("kind", ["exact", "tied"])
def test_pp2_vpp2_loss_and_every_gradient_match_single_process(vpp2, kind):
    for rank in vpp2:  # each rank compares both of its chunks' parameters
        assert rank[kind], rank
        for key, result in rank[kind].items():
            assert result.ok and result.tokens_computed == sum(dist_workers.LENGTHS), (key, result)


def test_receives_in_the_wrong_order_stop_the_job_instead_of_training_on_wrong_rows():
    # The check can fail: rows received in another order than the interleaved schedule sends them do not fit
    # the sent activations, and the ranks stop (gloo aborts on the size, or a rank splits rows it does not
    # have): no silent training on misplaced rows, no hang. The same launch with the right order is `vpp2`.
    with pytest.raises(LaunchError, match="Received data size doesn't match|SIGABRT|split_with_sizes"):
        launch(pipeline_workers.interleaved_with_a_wrong_receive_order, 4, timeout_s=120)


def test_a_plan_of_another_interleaving_is_refused_on_every_rank(vpp2):
    for rank in vpp2:
        assert rank["wrong"].startswith("the plan interleaves 1 chunks per stage at 1 stages, the model runs 2 at 2")


def test_tp2_pp2_matches_single_process():
    for rank in launch(pipeline_workers.tensor_and_pipeline_checks, 4, timeout_s=300):
        assert rank[False].ok and rank[True].ok and rank["sp"].ok, rank
