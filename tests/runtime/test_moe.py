"""Mixture of experts under dynamic plans: megatron-core's MoE layer with expert parallelism 2 on gloo ranks
against the single-process oracle (alltoall and allgather dispatchers), and the slot alignment (and, for
allgather, the equal slot rows) that keeps its collectives matched."""

from __future__ import annotations

import pytest
import torch

from megatron_dhp.launch.ranks import launch
from megatron_dhp.runtime.slots import PHASE_BARRIER, aligned_slot_counts, aligned_slot_rows, work_items
from megatron_dhp.runtime.step_data import StepInputs
from tests.numerics import RELATIVE
from tests.runtime import moe_workers
from tests.runtime.test_distributed import assert_exact


@pytest.fixture(scope="module")
def ep2() -> list[dict]:
    return launch(moe_workers.expert_parallel_checks, 4, timeout_s=500)


@pytest.mark.parametrize("plan", [*moe_workers.plans_of_four(), "ulysses"])
def test_expert_parallel_alltoall_matches_single_process(ep2, plan):
    for rank in ep2:
        assert rank["ep"] == 2
        assert_exact(rank["exact"][plan])


def test_each_rank_holds_its_half_of_the_experts(ep2):
    held = {tuple(rank["experts"]) for rank in ep2}
    assert len(held) == 2  # EP partners hold different experts, named by global index (compared with the oracle's)
    indices = {name.split("local_experts.")[1].split(".")[0] for names in held for name in names}
    assert indices == {"0", "1", "2", "3"}


def test_load_balancing_loss_is_exact_when_microbatches_are_samples(ep2):
    for rank in ep2:
        assert_exact(rank["aux"])
        # split differently, the router's per-microbatch statistics differ: only its gradient moves
        assert rank["aux_split"].max_loss_diff <= RELATIVE < rank["aux_split"].max_grad_diff
        assert "router" in rank["aux_split"].worst_param


@pytest.mark.parametrize("plan", [*moe_workers.plans_of_four(), "rounded rows", "ulysses"])
def test_expert_parallel_allgather_matches_single_process(ep2, plan):
    for rank in ep2:
        assert_exact(rank["allgather"][plan])


@pytest.fixture(scope="module")
def ep2_of_two() -> list[dict]:
    return launch(moe_workers.allgather_checks, 2, timeout_s=300)


@pytest.mark.parametrize("plan", list(moe_workers.plans_of_two()))
def test_allgather_over_a_domain_of_two_matches_single_process(ep2_of_two, plan):
    for rank in ep2_of_two:
        assert (rank["ep"], rank["tp_ep"], rank["domain"], rank["sp"]) == (2, 2, 2, False)
        assert_exact(rank["exact"][plan])


def test_allgather_with_tensor_and_sequence_parallelism_matches_single_process():
    ranks = launch(moe_workers.allgather_checks, 4, 2, timeout_s=400)
    for rank in ranks:
        # the dispatcher gathers over TP x EP = all 4 ranks, which hold two domains of 2
        assert (rank["ep"], rank["tp_ep"], rank["domain"], rank["sp"]) == (2, 4, 2, True)
        for result in rank["exact"].values():
            assert_exact(result)


def test_equal_rows_pad_every_slot_to_a_size_every_position_can_reach():
    # slot 0 of phase 0 holds 7, 1, 2, 2 rows: a pair pads its shards in steps of 2, so all pad to 8
    assert aligned_slot_rows(moe_workers.rounded_rows_of_four()) == ((8, 20), (28, 3))
    # under SP (TP 2) every shard grows in steps of 2: odd rows round up
    plan = moe_workers.plans_of_two()["1+1, counts 2/3, then 2"]
    assert aligned_slot_rows(plan) == ((26, 12, 16), (14, 18))
    assert aligned_slot_rows(plan, 2) == ((28, 14, 16), (14, 18))


def test_idle_slots_pad_to_their_slot_rows():
    plan = moe_workers.rounded_rows_of_four()
    rows = aligned_slot_rows(plan)
    inputs = StepInputs(plan=plan, microbatches=(), num_tokens=0, num_loss_tokens=0, slot_rows=rows)
    items = work_items(inputs, 1, aligned=True)  # as if position 1 ran nothing: every slot idle
    assert [item.layout.num_slots for item in items] == [8, 20, 28, 3]
    assert all(int(item.layout.real().sum()) == 1 and float(item.loss_mask.sum()) == 0 for item in items)


@pytest.mark.parametrize("name", list(moe_workers.plans_of_four()))
def test_aligned_slots_pad_every_phase_to_the_domain_maximum(name):
    plan = moe_workers.plans_of_four()[name]
    counts = aligned_slot_counts(plan)
    assert counts == {"1+1+2 then 2+2, counts 3/1/2/2": [3, 1], "2 across EP groups + idle, barrier": [3, 2]}[name]
    for position in range(4):
        inputs = StepInputs(plan=plan, microbatches=(), num_tokens=0, num_loss_tokens=0)
        items = work_items(inputs, position, aligned=True)
        phases = [[]]
        for item in items:
            if item is PHASE_BARRIER:
                phases.append([])
            else:
                phases[-1].append(item)
        assert [len(p) for p in phases] == (counts if plan.phase_barrier else [sum(counts)])


def test_the_router_runs_without_transformer_engine_on_any_device(monkeypatch):
    # megatron-core 0.16.1 defines the router GEMM's `te_general_gemm` only when TransformerEngine imports: a GPU
    # without TE hit a NameError in the MoE router, where only the CPU shim had guarded it. Every dynamic-CP
    # layer spec now defines it (None: megatron-core's torch fallback), with or without the shim.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils

    from megatron_dhp.runtime.layer_spec import with_dynamic_cp

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    with_dynamic_cp(get_gpt_layer_local_spec(num_experts=4), backend="local")
    assert moe_utils.te_general_gemm is None
    router = moe_utils.RouterGatingLinearFunction.apply
    inp, weight = torch.randn(3, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    torch.testing.assert_close(router(inp, weight, None, torch.float32), inp @ weight.t(), rtol=0, atol=0)
