"""The comm policy: one answer per question about communicators, without a process group."""

import pytest

from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.plan.comm import DEFAULT_COMMUNICATOR_MB, CommPolicy
from megatron_dhp.plan.family import group_family
from megatron_dhp.plan.memory import ModelMemory

FAMILY = group_family(64, 8)


def policy(**kw) -> CommPolicy:
    return DhpConfig(**kw).comm_policy(world_size=64, gpus_per_node=8)


@pytest.mark.parametrize("kw,startup,planning", [
    ({}, FAMILY, None),  # mixed: the family runs allgather, planners use any group
    ({"planner": "fcp-ref"}, FAMILY, None),
    ({"max_groups_per_rank": 0}, None, None),  # mixed without a family: every multi-rank group runs p2p
    ({"comm": "allgather"}, FAMILY, FAMILY),  # dhp keeps to the family it creates
    ({"layer_spec": "te"}, FAMILY, FAMILY),  # TransformerEngine: mixed runs as allgather
    ({"comm": "ring", "max_groups_per_rank": 16}, group_family(64, 8, 16), group_family(64, 8, 16)),
    ({"comm": "allgather", "max_groups_per_rank": 0}, None, None),
    ({"comm": "allgather", "planner": "fcp-ref"}, None, None),  # a peer plans as published
    ({"comm": "allgather", "planner": "fcp-ref", "max_groups_per_rank": 32}, FAMILY, FAMILY),  # held on request
    ({"comm": "p2p"}, None, None),  # no group needs a communicator
])
def test_which_groups_exist_and_which_the_planner_keeps_to(kw, startup, planning):
    p = policy(**kw)
    assert p.startup_groups == (startup.groups if startup is not None else ())
    assert p.planning_family == planning
    assert p.creates_later == (kw.get("comm") in ("allgather", "ring") and startup is None)


def test_how_each_group_talks():
    mixed, in_family, outside = policy(), (0, 1, 2), (1, 3)
    assert FAMILY.contains(in_family) and not FAMILY.contains(outside)
    assert (mixed.transport(in_family), mixed.transport(outside), mixed.transport((5,))) == ("allgather", "p2p", "allgather")
    assert policy(max_groups_per_rank=0).transport(in_family) == "p2p"
    for comm in ("allgather", "ring", "ulysses", "p2p"):
        assert policy(comm=comm).transport(outside) == comm
    assert policy(layer_spec="te").transport(outside) == "allgather"


def test_config_keeps_what_the_user_wrote_and_exposes_the_effective_comm():
    config = DhpConfig(layer_spec="te")
    assert (config.comm, config.effective_comm) == ("mixed", "allgather")
    assert DhpConfig().effective_comm == "mixed"


@pytest.mark.parametrize("kw,match", [
    ({"comm": "p2p", "layer_spec": "te"}, "gives a group no process group"),
    ({"comm": "smoke"}, "comm 'smoke' is unknown"),
    ({"max_groups_per_rank": -1}, "max_groups_per_rank = -1"),
    ({"communicator_mb": -1.0}, "communicator_mb = -1.0"),
    ({"memory_mb_per_token": -1.0}, "memory_mb_per_token = -1.0"),
])
def test_bad_settings_are_clear_errors(kw, match):
    with pytest.raises(DhpError, match=match):
        DhpConfig(**kw)


def test_communicator_memory_is_stated_and_taken_from_the_token_cap():
    from megatron_dhp.integration.job_spec import JobSpec

    p = policy()
    assert p.communicators_per_rank == FAMILY.max_membership == 32
    assert p.memory_per_rank_mb == 32 * DEFAULT_COMMUNICATOR_MB
    assert f"at most 32 per rank (~{32 * DEFAULT_COMMUNICATOR_MB / 1024:.1f} GB" in p.summary()
    assert policy(comm="p2p").memory_per_rank_mb == 0.0

    def cap(config, model=None, device="cuda"):
        return JobSpec(config, 64, 8, device_type=device, model=model).caps.planner

    model = ModelMemory.of_gpt(hidden=4096, ffn_hidden=14336, layers=32, kv_channels=1024)  # 4 MB per token
    given = DhpConfig(max_tokens_per_rank=32768, communicator_mb=500.0, memory_mb_per_token=2.0)
    assert cap(given) == cap(given, model) == 32768 - 32 * 500 // 2  # the given rate wins
    assert cap(DhpConfig(max_tokens_per_rank=32768), model) == 32768 - round(32 * DEFAULT_COMMUNICATOR_MB / 4.0)
    assert cap(DhpConfig(max_tokens_per_rank=32768)) == 32768  # no model, no rate: unchanged
    assert cap(DhpConfig(max_tokens_per_rank=32768, memory_mb_per_token=0.0), model) == 32768
    assert cap(given, model, device="cpu") == 32768  # a CPU job's communicators hold no GPU memory
    with pytest.raises(DhpError, match="lower max_groups_per_rank or raise max_tokens_per_rank"):
        cap(DhpConfig(max_tokens_per_rank=1024, memory_mb_per_token=1.0))


def test_gathered_keys_and_values_count_where_a_group_keeps_them():
    assert policy(comm="allgather").gathers_kv and policy(comm="mixed").gathers_kv
    assert not policy(comm="mixed", max_groups_per_rank=0).gathers_kv  # every group runs p2p
    assert not policy(comm="ring").gathers_kv and not policy(comm="ulysses").gathers_kv
    assert not policy(comm="p2p").gathers_kv
    assert policy(comm="ring", layer_spec="te").gathers_kv  # TE's all_gather may: counted whatever it runs


def test_live_cost_model_counts_a_gpu_job_s_communicators_and_gathered_keys_and_values():
    from megatron_dhp.integration.job_spec import JobSpec

    model = ModelMemory.of_gpt(hidden=4096, ffn_hidden=14336, layers=32, kv_channels=1024)
    spec = JobSpec(DhpConfig(max_tokens_per_rank=32768), 64, 8, device_type="cuda", model=model)
    cost = spec.cost
    assert cost.max_tokens_per_rank == 32768 - round(32 * DEFAULT_COMMUNICATOR_MB / 4.0)
    assert cost.kv_memory_per_token == pytest.approx(1 / 32)
    line = spec.memory_line()
    assert f"token cap {cost.max_tokens_per_rank} per rank" in line and "estimated from the model" in line
    assert "gathered keys and values count 0.0312" in line
    ring = JobSpec(DhpConfig(max_tokens_per_rank=32768, comm="ring", memory_mb_per_token=0.0), 64, 8,
                   device_type="cuda", model=model)
    assert (ring.cost.max_tokens_per_rank, ring.cost.kv_memory_per_token) == (32768, 0.0)
    cpu = JobSpec(DhpConfig(max_tokens_per_rank=32768), 64, 8, model=model)
    assert (cpu.cost.max_tokens_per_rank, cpu.cost.kv_memory_per_token) == (32768, 0.0)  # a CPU job: as stated
    assert "a CPU job's communicators hold no GPU memory" in cpu.memory_line()


def test_profile_times_every_group_on_its_own_communicator():
    assert (policy().for_profiling().effective_comm, policy().for_profiling().startup_groups) == ("allgather", ())
    assert policy(comm="p2p").for_profiling().effective_comm == "p2p"
    assert policy(comm="ring").for_profiling().creates_later


def test_resolve_on_a_one_rank_domain_has_no_family():
    p = CommPolicy.resolve("mixed", world_size=1, gpus_per_node=1)
    assert p.startup_groups == () and p.memory_per_rank_mb == 0.0


def test_a_registered_planner_must_declare_its_traits(monkeypatch):
    from megatron_dhp.solver import PLANNERS, build_planner

    class Bare:  # traits such as `plans_on_family` come from subclassing `Planner`
        name = "bare"

    monkeypatch.setitem(PLANNERS, "bare", Bare)
    with pytest.raises(DhpError, match="'bare' \\(Bare\\) must subclass megatron_dhp.solver.Planner"):
        build_planner("bare")
