"""Fully sharded data parallelism: sharded states in the cost model's token cap, and bench/fsdp_tp.py's slot
traffic and plan priced in lockstep slots (every rank joins every microbatch's gathers), by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.cost.tensor_parallel import per_position, token_cap
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.workload.sample import Sample
from tests.bench_scripts import load_bench

fsdp_tp = load_bench("fsdp_tp")
lockstep_step, slot_traffic_s = fsdp_tp.lockstep_step, fsdp_tp.slot_traffic_s

# one token-second per token on one rank, nothing else: a sample of L tokens on d ranks takes L / d seconds
UNIT = CostConfig(kind="reference", world_size=4, gpus_per_node=2, max_tokens_per_rank=100, attn_s_per_token2=0.0,
                  linear_s_per_token=1.0, microbatch_overhead_s=0.0, comm_bytes_per_token=0.0,
                  intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e9, overlap_comm=True)


def test_sharded_states_count_one_nth_per_gpu_in_the_token_cap():
    c = replace(UNIT, world_size=8, gpus_per_node=8, memory_budget_bytes=100.0, model_state_bytes=80.0,
                sharded_state_bytes=160.0, activation_bytes_per_token=1.0)
    # per GPU at TP t: 80 / t of the states and 160 / 8 of the sharded ones; the rest over 1 / t of a token
    assert token_cap(c, 2) == (100 - 40 - 20) * 2 and token_cap(c, 4) == (100 - 20 - 20) * 4
    with pytest.raises(Exception, match="leave no room"):
        token_cap(c, 1)  # 80 + 20 = the whole budget


def test_a_slots_traffic_is_a_ring_over_the_domain_at_one_tth_of_the_bytes():
    c = replace(UNIT, world_size=16, gpus_per_node=8, fsdp_gather_bytes=6e9, inter_node_bytes_per_s=2e9)
    assert slot_traffic_s(c) == pytest.approx(6e9 * 15 / 16 / 2e9)
    position = per_position(replace(c, tensor_parallel=8))  # 2 positions of 8 GPUs: 1 / 8 of the bytes
    assert slot_traffic_s(position) == pytest.approx(6e9 / 8 * 1 / 2 / 2e9)
    assert slot_traffic_s(replace(c, world_size=8)) == pytest.approx(6e9 * 7 / 8 / 1e9)  # one node: intra


def plan() -> Plan:
    """Phase 0: ranks 0-1 run microbatches of 3 s and 1 s, ranks 2-3 one of 2 s; phase 1: all four, 1 s."""
    samples = (Sample(0, 6), Sample(1, 2), Sample(2, 4), Sample(3, 4))
    groups = (PlanGroup((0, 1), ((0,), (1,))), PlanGroup((2, 3), ((2,),)), PlanGroup((0, 1, 2, 3), ((3,),), phase=1))
    return Plan("test", 4, 2, samples, groups)


@pytest.mark.parametrize(("traffic", "overlap", "step"), [
    (0.0, True, 3 + 1 + 1),  # slot 0: max(3, 2); slot 1: rank 2-3 idle but joins; phase 1: 1
    (2.5, True, 3 + 2.5 + 2.5),  # every slot at least its traffic
    (2.5, False, 3 + 1 + 1 + 3 * 2.5),  # traffic after each slot's compute
])
def test_a_plan_runs_in_lockstep_slots(traffic, overlap, step):
    model = build_cost_model(UNIT)
    assert simulate(plan(), model).step_time_s == 5.0  # unlocked: 4 s on ranks 0-1, then 1 s
    assert lockstep_step(plan(), model, traffic, overlap) == pytest.approx(step)


def test_lockstep_is_never_faster_than_the_unlocked_step():
    model = build_cost_model(UNIT)
    p = Plan("test", 4, 2, plan().samples, (PlanGroup((0, 1), ((0,),)), PlanGroup((2, 3), ((1,), (2,), (3,)))))
    # unlocked 5 s on ranks 2-3 (1 + 2 + 2); locked: slot 0 max(3, 1), then 2 and 2
    assert simulate(p, model).step_time_s == 5.0 and lockstep_step(p, model, 0.0, True) == 7.0
