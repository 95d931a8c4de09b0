"""The user-facing DHP config and the step planner that overlaps planning with training."""

from __future__ import annotations

import pytest

from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.integration.job_spec import JobSpec
from megatron_dhp.integration.planning import JobPlanner, domain_node_size
from megatron_dhp.workload import Batch


def test_defaults_and_yaml(tmp_path):
    p = tmp_path / "dhp.yaml"
    p.write_text("planner: static\nmax_tokens_per_rank: 4096\ncomm: ring\ngpus_per_node: 4\n")
    c = DhpConfig.load(p)
    assert (c.planner, c.max_tokens_per_rank, c.comm, c.gpus_per_node, c.overlap_planning) == ("static", 4096, "ring", 4, True)


@pytest.mark.parametrize(
    "obj,match",
    [
        ({"planer": "dhp"}, "unknown key 'planer'; did you mean 'planner'"),
        ({"planner": "magic"}, "planner 'magic' is unknown"),
        ({"comm": "a2a"}, "comm 'a2a' is unknown; choose one of allgather, ring, ulysses, p2p"),
        ({"comm": "p2p", "layer_spec": "te"}, "comm 'p2p' gives a group no process group"),
        ({"max_tokens_per_rank": "8k"}, "key 'max_tokens_per_rank' = '8k' must be an integer"),
        ({"max_tokens_per_rank": 0}, "max_tokens_per_rank = 0 must be >= 1"),
        ({"overlap_planning": "yes"}, "key 'overlap_planning' = 'yes' must be true or false"),
        ({"gpus_per_node": 0}, "gpus_per_node = 0 must be >= 1"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_values_are_clear(obj, match):
    with pytest.raises(DhpError, match=match):
        DhpConfig.from_dict(obj)


def test_missing_file():
    with pytest.raises(DhpError, match="dhp config 'nope.yaml' does not exist"):
        DhpConfig.load("nope.yaml")


def test_live_cost_config_takes_the_job_domain():
    cost = JobSpec(DhpConfig(max_tokens_per_rank=1024), 6, 3).cost
    assert (cost.world_size, cost.gpus_per_node, cost.max_tokens_per_rank) == (6, 3, 1024)
    assert cost.attn_s_per_token2 == 5.128e-9  # the rest from the gpt7b-64 preset


def test_node_size_counts_the_domains_ranks_on_a_node_of_gpus(monkeypatch):
    tp2_domain = tuple(range(0, 32, 2))  # 32 GPUs, TP 2: one domain of 16 ranks at stride 2
    assert domain_node_size(DhpConfig(gpus_per_node=8), tp2_domain, 32) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert domain_node_size(DhpConfig(), tp2_domain, 32) == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert domain_node_size(DhpConfig(), (1, 3), 4) == 2  # one machine: the whole world


@pytest.mark.parametrize("overlap", [True, False])
def test_prefetched_plan_equals_a_direct_one(overlap):
    config = DhpConfig(max_tokens_per_rank=2048, overlap_planning=overlap)
    policy = config.comm_policy(world_size=4, gpus_per_node=4)
    planner = JobPlanner(config, JobSpec(config, 4, 4).cost, policy)
    batch, other = Batch.from_lengths([100, 3000, 50, 8000, 700]), Batch.from_lengths([5, 6])
    planner.prefetch(batch)
    ahead = planner.plan(batch)
    planner.prefetch(batch)
    assert planner.plan(other).samples == other.samples  # a different batch is planned directly
    direct = planner.plan(batch)
    planner.close()
    assert ahead.fingerprint() == direct.fingerprint()
    ahead.validate()
