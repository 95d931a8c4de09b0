"""One job spec: the parallel sizes and the token-cap chain every entry point reads, built with no process group."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_dhp.cost import build_cost_model
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.integration.job_spec import JobSpec
from megatron_dhp.plan.memory import ModelMemory, longest_sample
from megatron_dhp.plan.pipeline import pipeline_token_cap
from megatron_dhp.runtime.domain import DynamicDomain
from tests.configs import GPT7B

LLAMA = ModelMemory.of_gpt(hidden=4096, ffn_hidden=14336, layers=32, kv_channels=1024)  # 4 MB per token, g 1/32


def test_the_token_cap_chain_runs_in_one_order_and_the_planner_holds_its_end(tmp_path):
    """The user's M, then the cost model's memory budget (it replaces M), then the communicators, then P, then the
    longest sample with its gathered keys and values. The planner's cost model carries the chain's M with the
    budget applied, so building it does not derive M again (it did: 4,096 became the budget's M at model build
    while the data checks kept 4,096)."""
    path = tmp_path / "budget.yaml"
    replace(GPT7B, memory_budget_bytes=80e9, model_state_bytes=0.0,
            activation_bytes_per_token=2e6).save(path)
    config = DhpConfig(max_tokens_per_rank=4096, cost=str(path))
    spec = JobSpec(config, 64, 8, pipeline_stages=2, device_type="cuda", model=LLAMA)
    caps = spec.caps
    assert caps.stated == 4096 and caps.budget == 40000  # 80 GB over 2 MB a token
    assert caps.planner == 40000 - round(32 * 600 / 4.0)  # the family's 32 communicators at 4 MB a token
    assert caps.microbatch == pipeline_token_cap(caps.planner, 2) == caps.planner // 2
    assert caps.longest_sample == longest_sample(caps.microbatch, 64, 1 / 32)
    assert build_cost_model(spec.cost).domain.max_tokens_per_rank == caps.planner
    assert "under the memory budget" in spec.memory_line()
    plain = JobSpec(DhpConfig(max_tokens_per_rank=4096), 64, 8)
    assert (plain.caps.budget, plain.caps.planner, plain.caps.longest_sample) == (4096, 4096, 64 * 4096)
    assert plain.stated_cap_for(64 * 4096 + 1) == 4097


@pytest.mark.parametrize("fields,match", [
    ({"virtual_stages": 2}, "virtual_stages = 2 interleaves model chunks of a pipeline: it needs pipeline_stages >= 2"),
    ({"gpus_per_node": 16}, "gpus_per_node = 16 exceeds the domain's 8 positions"),
    ({"tensor_parallel": 0}, "tensor_parallel = 0 must be >= 1"),
])
def test_a_job_that_cannot_be_is_a_clear_error(fields, match):
    with pytest.raises(DhpError, match=match):
        JobSpec(DhpConfig(), **{"domain_size": 8, "gpus_per_node": 8, **fields})


@pytest.mark.parametrize("fields,want", [
    ({}, (1, False, False, False)),
    ({"tensor_parallel": 2, "sequence_parallel": True}, (2, False, False, False)),
    ({"tensor_parallel": 2}, (1, False, False, False)),
    ({"expert_parallel": 2, "moe_dispatcher": "alltoall"}, (1, True, False, False)),
    ({"expert_parallel": 2, "moe_dispatcher": "allgather"}, (1, True, True, False)),
    ({"fully_sharded": True}, (1, True, False, False)),
    ({"pipeline_stages": 2, "virtual_stages": 2}, (1, False, False, True)),
])
def test_the_step_engine_takes_its_options_from_the_spec(fields, want):
    """The one builder: shard multiple (TP under SP), slot rules (EP, its dispatcher, FSDP), pipelining."""
    domain = DynamicDomain(global_ranks=(0, 1), rank=0, all_domains=((0, 1),))
    engine = JobSpec(DhpConfig(attention_backend="sdpa"), 2, 2, **fields).engine(domain, None)
    assert (engine.seq_multiple, engine.aligned_slots, engine.equal_rows, engine.pipelined) == want
    assert engine.backend == "sdpa" and engine.policy.world_size == 2


def test_the_planner_gives_uneven_shards_only_where_the_attention_runs_them():
    """TransformerEngine's THD context parallelism knows only even zigzag shards (`runtime.engine.check_shares`
    refuses others), so a job on layer_spec te plans with even shards; the local layer spec keeps the default."""
    speeds = [1.0] * 4 + [0.5] * 4
    te = JobSpec(DhpConfig(layer_spec="te", rank_speeds=speeds), 8, 8)
    local = JobSpec(DhpConfig(layer_spec="local", rank_speeds=speeds), 8, 8)
    assert te.cost.uneven_shards is False and local.cost.uneven_shards is True
    model = build_cost_model(te.cost)
    assert model.group_shares(range(8)) == () and build_cost_model(local.cost).group_shares(range(8)) == (2,) * 4 + (1,) * 4


def test_a_slow_rank_past_the_world_size_is_refused_where_the_world_size_is_known():
    """Megatron-LM's and Bridge's hooks build the spec with `for_domain`: `--dhp-slow-rank 7:2` on 2 ranks would
    slow nobody."""
    domain = DynamicDomain(global_ranks=(0, 1), rank=0, all_domains=((0, 1),))
    with pytest.raises(DhpError, match=r"slow rank 7:2 names rank 7, but the job has 2 ranks \(0 to 1\)"):
        JobSpec.for_domain(DhpConfig(slow_ranks=("7:2",)), domain, world_size=2)
    assert JobSpec.for_domain(DhpConfig(slow_ranks=("1:2",)), domain, world_size=2).domain_size == 2
