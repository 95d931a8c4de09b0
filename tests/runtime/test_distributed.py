"""Multi-process gloo runs of the whole runtime against the single-process oracle.

Two launches (4 ranks with TP 1, 4 ranks with TP 2) share their start-up across all the checks; each is
bounded by a deadline, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

from collections import Counter

import pytest

from megatron_dhp.launch.ranks import launch
from megatron_dhp.plan.comm import COMM_VARIANTS
from megatron_dhp.verify.selfcheck import random_samples
from tests.numerics import RELATIVE
from tests.runtime import dist_workers


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return launch(dist_workers.domain_of_four_checks, 4, timeout_s=400)


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return launch(dist_workers.tensor_parallel_checks, 4, timeout_s=300)


def assert_exact(result):
    assert result.max_loss_diff <= RELATIVE and result.max_grad_diff <= RELATIVE, result
    assert result.tokens_computed == result.batch_tokens == sum(dist_workers.LENGTHS), result
    assert result.loss_tokens_computed == result.batch_loss_tokens, result
    assert result.ok


@pytest.mark.parametrize("comm", COMM_VARIANTS)
@pytest.mark.parametrize("plan", list(dist_workers.plans_of_four()))
def test_loss_and_every_gradient_match_single_process(four, plan, comm):
    sizes = {g.size for p in dist_workers.plans_of_four().values() for g in p.groups}
    assert sizes == {1, 2, 3, 4}
    for rank in four:
        assert_exact(rank["exact"][(plan, comm)])


def test_ulysses_with_fewer_heads_than_ranks(four):
    # 2 heads, 1 kv head: a group of 3 or 4 leaves some ranks without a head
    for result in four[0]["two_heads"]:
        assert_exact(result)


def test_every_token_dispatched_exactly_once_with_its_labels(four):
    samples = {s.id: s for s in random_samples(dist_workers.batch(), vocab_size=128, seed=dist_workers.SAMPLE_SEED)}
    slots = [slot for rank in four for slot in rank["slots"]]
    counts = Counter((sid, pos) for sid, pos, *_ in slots)
    assert set(counts) == {(sid, p) for sid, s in samples.items() for p in range(s.length)}
    assert set(counts.values()) == {1}
    for sid, pos, token, label, mask in slots:
        s = samples[sid]
        assert (token, label, mask) == (int(s.input_ids[pos]), int(s.labels[pos]), float(s.loss_mask[pos]))


def test_warm_run_creates_no_group(four):
    for rank in four:
        assert rank["warm_created"] == rank["cold_created"] == 5  # (0,1,2) (0,1,2,3) (1,3) (0,2) (0,1,3)
        assert rank["hits"] >= 2


def test_p2p_steps_create_no_group(four):
    """Both plans' steps under p2p (groups of 1 to 4 ranks, non-contiguous, an idle rank) ask their pool nothing."""
    for rank in four:
        assert rank["p2p_pool"] == (0, 0, 0)


def test_a_family_pool_creates_its_groups_at_start_up_and_none_for_plans_inside_it(four):
    for rank in four:
        assert_exact(rank["family_exact"])
        assert rank["family_in"] == (5, 0, 2, 5)  # a plan held to the family creates nothing after start-up
        assert rank["family_out"] == (3, 8)  # (0,2) (1,3) (0,1,3) are not in it: created, and counted


def test_mixed_runs_family_groups_on_their_communicators_and_others_by_p2p_exactly(four):
    """Under `mixed` the family's groups (0,1,2), (0,1,2,3) run allgather, the others ((1,3), (0,2), (0,1,3)) the
    ring on the domain's communicator; loss and every gradient match one process, and no group is created."""
    for rank in four:
        inside, outside = rank["mixed"].values()
        assert_exact(inside)
        assert_exact(outside)
        assert set(inside.slots_by_comm) <= {"allgather"}, inside.slots_by_comm
        assert rank["mixed_pool"] == (0, 5)
        assert rank["outside"] == [0, 3]  # what the logs print: (1,3) (0,2) (0,1,3) ran on p2p
    mixed_outside = Counter()
    for rank in four:
        mixed_outside.update(rank["mixed"]["sizes 2+2 non-contiguous, then 3 + idle 1, barrier"].slots_by_comm)
    assert mixed_outside["p2p"] > 0 and "allgather" not in mixed_outside, mixed_outside


def test_lru_cap_releases_and_recreates(four):
    for rank in four:
        assert rank["lru"] == (5, 2, 3)  # 2 + 3 distinct groups over two plans, cap 3: the first two go
        assert rank["lru_after"] == (7, 4, 3)  # they come back, evicting the two least recently used
        assert_exact(rank["lru_exact"])


def test_rank_with_a_different_plan_stops_every_rank_with_a_clear_error(four):
    messages = [rank["divergent"] for rank in four]
    assert all("ranks hold different plans" in m and "fingerprint" in m for m in messages), messages
    assert "rank 2 has fingerprint" in messages[2] and "ranks [0, 1, 3] have" in messages[2]
    assert "ranks [2] have" in messages[0]


def test_rank_rejecting_the_plan_stops_every_rank(four):
    messages = [rank["mislabelled"] for rank in four]
    assert "sample 3 has 26 tokens but the plan says 27" in messages[1]
    assert all("ranks [1] rejected the plan" in m for i, m in enumerate(messages) if i != 1), messages


def test_job_keeps_working_after_the_errors(four):
    for rank in four:
        assert_exact(rank["after_errors"])


@pytest.mark.parametrize("comm", COMM_VARIANTS)
def test_tensor_parallel_two_matches_single_process(tp2, comm):
    assert sorted(rank["domain"] for rank in tp2) == [(0, 2), (0, 2), (1, 3), (1, 3)]
    for rank in tp2:
        assert_exact(rank["exact"][comm])


@pytest.mark.parametrize("comm", COMM_VARIANTS)
def test_sequence_parallel_over_a_domain_of_two_matches_single_process(tp2, comm):
    for rank in tp2:
        assert_exact(rank["sp"][comm])
        assert rank["sp"][comm].tokens_computed == rank["sp"][comm].batch_tokens  # padding rows are no tokens


def test_sequence_parallel_over_a_domain_of_three_matches_single_process():
    ranks = launch(dist_workers.sequence_parallel_three_checks, 6, timeout_s=500)
    for rank in ranks:
        assert (rank["tp"], rank["sp"]) == (2, True)
        for comm in COMM_VARIANTS:
            assert_exact(rank["exact"][comm])


def test_init_distributed_does_not_switch_the_cpu_shim_on():
    """A library call must leave megatron-core as shipped; only a CPU entry point calls `apply_cpu_compat`."""
    (result,) = launch(dist_workers.init_distributed_leaves_megatron_core_alone, 1, timeout_s=200)
    unpatched = {"applied": False, "current_device": "torch.cuda", "literals_redirected": False}
    assert result["before"] == unpatched and result["after"] == unpatched, result


def test_the_control_plane_carries_every_host_read_collective_and_changes_nothing():
    """On NCCL each step's gather, plan broadcast, plan check and token move run on host (gloo) twins of the
    domain and the world, so reading their results waits for no GPU: here on gloo twins of a gloo job, the
    same microbatches, and every one of those collectives on a twin (the two row gathers and the token move on
    the domain's, the two plan broadcasts and the check on the world's)."""
    results = launch(dist_workers.control_plane_checks, 4, timeout_s=300)
    for rank in results:
        assert rank["same"], rank
        assert Counter(rank["used"]) == {"domain": 3, "world": 3}, rank["used"]
