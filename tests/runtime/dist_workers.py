"""Functions the multi-process tests run on every spawned rank (importable by name, results picklable).

Each launch shares one process start-up across many checks; the tests in `test_distributed.py` assert on
the returned values.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.models.gpt import TinyGPTConfig
from megatron_dhp.plan.comm import COMM_VARIANTS, DOMAIN_COMMS
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime import collectives
from megatron_dhp.runtime.distributed import init_distributed
from megatron_dhp.runtime.domain import ControlPlane, host_groups
from megatron_dhp.runtime.group_pool import GroupPool
from megatron_dhp.runtime.step_data import local_slice
from megatron_dhp.testing.dispatch import dispatch
from megatron_dhp.verify.selfcheck import random_samples
from megatron_dhp.workload.sample import Batch
from tests.numerics import RelativeSelfCheck
from tests.ranks import start_cpu_rank

LENGTHS = (7, 19, 4, 26, 11, 1, 16, 9, 13, 3, 22, 6)
SAMPLE_SEED = 11


def batch() -> Batch:
    return Batch.from_lengths(LENGTHS)


def plans_of_four() -> dict[str, Plan]:
    """Hand-written plans on a domain of 4 that between them use group sizes 1, 2, 3 and 4."""
    b = batch().samples
    return {
        "sizes 3+1 then 4": Plan("t", 4, 4, b, (
            PlanGroup((0, 1, 2), ((0, 1, 2), (3,), (4, 5))),
            PlanGroup((3,), ((6, 7), (8,))),
            PlanGroup((0, 1, 2, 3), ((9, 10, 11),), phase=1),
        )),
        "sizes 2+2 non-contiguous, then 3 + idle 1, barrier": Plan("t", 4, 4, b, (
            PlanGroup((1, 3), ((0, 3), (5,))),
            PlanGroup((2, 0), ((1, 2, 4),)),
            PlanGroup((3, 0, 1), ((6, 7, 8, 9), (10, 11)), phase=1),
            PlanGroup((2,), (), phase=1),
        ), phase_barrier=True),
    }


def domain_of_four_checks() -> dict:
    """TP 1 on 4 ranks: exactness per plan and variant, token coverage, pool reuse and LRU, plan divergence,
    no group created by p2p's steps."""
    start_cpu_rank(tensor_parallel=1)
    out: dict = {"rank": dist.get_rank()}
    check = RelativeSelfCheck(seed=5)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    plans = plans_of_four()

    pools = {"groups": check.pool, "p2p": GroupPool(check.domain)}  # p2p's steps get a pool of their own
    out["exact"] = {}
    for name, plan in plans.items():
        for comm in COMM_VARIANTS:
            check.pool = pools["p2p" if comm in DOMAIN_COMMS else "groups"]
            out["exact"][name, comm] = check.check(plan, samples, comm)
    check.pool = pools["groups"]
    out["p2p_pool"] = (pools["p2p"].created, pools["p2p"].hits, len(pools["p2p"]))

    created = check.pool.created
    check.check(plans["sizes 3+1 then 4"], samples, "allgather")
    out["warm_created"], out["cold_created"], out["hits"] = check.pool.created, created, check.pool.hits

    plan = plans["sizes 2+2 non-contiguous, then 3 + idle 1, barrier"]
    inputs = dispatch(local_slice(samples, check.domain.position, 4), check.domain, plan=plan)
    out["slots"] = [
        (sid, int(pos), int(tok), int(lab), float(mask))
        for mb in inputs.microbatches
        for sid, seg_start in zip(mb.layout.sample_ids, mb.layout.local_cu_seqlens[:-1].tolist())
        for pos, tok, lab, mask, seg, real in zip(
            mb.position_ids, mb.input_ids, mb.labels, mb.loss_mask, mb.layout.segments, mb.layout.real()
        )
        if real and int(seg) == mb.layout.sample_ids.index(sid)
    ]

    out["divergent"] = _expect_error(check, samples, _divergent(plans["sizes 3+1 then 4"]))
    out["mislabelled"] = _expect_error(check, samples, _mislabelled(plans["sizes 3+1 then 4"]))
    out["after_errors"] = check.check(plans["sizes 3+1 then 4"], samples, "ring")

    small = GroupPool(check.domain, max_groups=3)
    check.pool = small
    for name in ("sizes 3+1 then 4", "sizes 2+2 non-contiguous, then 3 + idle 1, barrier"):
        small.prepare(plans[name])
    out["lru"] = (small.created, small.released, len(small))
    out["lru_exact"] = check.check(plans["sizes 3+1 then 4"], samples, "ulysses")
    out["lru_after"] = (small.created, small.released, len(small))

    check.use_family(32)  # (0,1) (2,3) (0,1,2) (1,2,3) (0,1,2,3)
    family = check.pool
    out["family_exact"] = check.check(plans["sizes 3+1 then 4"], samples, "ring")  # both groups in the family
    out["family_in"] = (family.at_startup, family.created, family.hits, len(family))
    # mixed: a group of the family runs allgather on it, any other the p2p ring on the domain's communicator
    out["mixed"] = {name: check.check(plan, samples, "mixed") for name, plan in plans.items()}
    out["mixed_pool"] = (family.created, len(family))
    mixed = check.policy("mixed")
    out["outside"] = [mixed.on_domain(plan.multi_rank_groups()) for plan in plans.values()]
    family.prepare(plans["sizes 2+2 non-contiguous, then 3 + idle 1, barrier"])  # none of its groups is
    out["family_out"] = (family.created, len(family))

    two_heads = RelativeSelfCheck(config=TinyGPTConfig(hidden_size=32, num_attention_heads=2, num_query_groups=1), seed=6)
    out["two_heads"] = [two_heads.check(p, samples, "ulysses") for p in plans.values()]
    return out


def tensor_parallel_checks() -> dict:
    """TP 2 on 4 ranks (two domains of 2): exactness for every variant on a plan with sizes 1 and 2."""
    start_cpu_rank(tensor_parallel=2)
    check = RelativeSelfCheck(seed=7)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    b = batch().samples
    plan = Plan("t", 2, 2, b, (
        PlanGroup((0,), ((0, 1, 2), (3,))),
        PlanGroup((1,), ((4, 5, 6),)),
        PlanGroup((0, 1), ((7, 8), (9, 10, 11)), phase=1),
    ))
    out = {"domain": check.domain.global_ranks, "exact": {comm: check.check(plan, samples, comm) for comm in COMM_VARIANTS}}
    sp = RelativeSelfCheck(config=TinyGPTConfig(sequence_parallel=True), seed=7)
    out["sp"] = {comm: sp.check(plan, samples, comm) for comm in COMM_VARIANTS}
    return out


def sequence_parallel_three_checks() -> dict:
    """TP 2 + SP on 6 ranks (two domains of 3): groups of 3, 2 and 1, odd lengths, every variant."""
    start_cpu_rank(tensor_parallel=2)
    check = RelativeSelfCheck(config=TinyGPTConfig(sequence_parallel=True), seed=8)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    b = batch().samples
    plan = Plan("t", 3, 3, b, (
        PlanGroup((0, 2), ((0, 1), (2, 3))),
        PlanGroup((1,), ((4, 5, 6),)),
        PlanGroup((0, 1, 2), ((7, 8), (9, 10, 11)), phase=1),
    ))
    out = {"tp": check.model.config.tensor_model_parallel_size, "sp": check.model.config.sequence_parallel,
           "exact": {comm: check.check(plan, samples, comm) for comm in COMM_VARIANTS}}
    return out


def _expect_error(check: RelativeSelfCheck, samples: list, plan_for_rank) -> str:
    plan = plan_for_rank(check.domain.position)
    try:
        dispatch(local_slice(samples, check.domain.position, check.domain.size), check.domain, plan=plan)
    except DhpError as e:
        return str(e)
    return "no error"


def _divergent(plan: Plan):
    """Position 2 holds the same plan with its last two microbatches merged: a different fingerprint."""
    other = replace(plan, groups=(replace(plan.groups[0], microbatches=((0, 1, 2), (3, 4, 5))), *plan.groups[1:]))
    return lambda position: other if position == 2 else plan


def _mislabelled(plan: Plan):
    """Position 1 holds a plan whose sample 3 has the wrong length: it rejects locally, everyone stops."""
    samples = tuple(replace(s, tokens=s.tokens + 1) if s.id == 3 else s for s in plan.samples)
    other = replace(plan, samples=samples)
    return lambda position: other if position == 1 else plan


def init_distributed_leaves_megatron_core_alone() -> dict:
    """One fresh rank: the CPU shim's marks before and after `init_distributed` (CPU entry points switch it on)."""
    import importlib

    import torch

    from megatron_dhp.launch import cpu_shim as cpu_compat

    def marks() -> dict:
        utils = importlib.import_module("megatron.core.transformer.utils")
        return {"applied": cpu_compat._APPLIED, "current_device": torch.cuda.current_device.__module__,
                "literals_redirected": utils.torch is not torch}

    before = marks()
    try:
        init_distributed(tensor_parallel=1, timeout=timedelta(seconds=60))
        error = ""
    except Exception as e:  # noqa: BLE001 - on a CPU machine megatron-core without the shim refuses; expected
        error = f"{type(e).__name__}: {e}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"before": before, "after": marks(), "error": error}


class _GivenPlan:
    """A plan source that hands rank 0 a fixed plan, so the step broadcasts it."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def plan(self, batch: Batch) -> Plan:
        return self._plan

    def prefetch(self, batch: Batch) -> None:
        pass


def control_plane_checks() -> dict:
    """4 ranks: one step's gather, plan broadcast, plan check and token move on host twins of the domain and
    the world (`ControlPlane`), against the same step without: the same microbatches, and every control
    collective on a control group."""
    start_cpu_rank(tensor_parallel=1)
    check = RelativeSelfCheck(seed=5)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    plan = plans_of_four()["sizes 2+2 non-contiguous, then 3 + idle 1, barrier"]
    local = local_slice(samples, check.domain.position, 4)
    twins = host_groups(check.domain.all_domains, check.domain.timeout)
    control = ControlPlane(twins[check.domain.global_ranks], dist.new_group(backend="gloo"))
    names = {id(control.domain): "domain", id(control.world): "world"}
    used: list[str] = []

    def recorded(fn):
        def call(*args, group=None, **kwargs):
            used.append(names.get(id(group), f"other {group}"))
            return fn(*args, group=group, **kwargs)
        return call

    plain = dispatch(local, check.domain, planner=_GivenPlan(plan))
    with mock.patch.object(collectives, "all_gather_single", recorded(collectives.all_gather_single)), \
            mock.patch.object(dist, "broadcast", recorded(dist.broadcast)), \
            mock.patch.object(dist, "all_to_all_single", recorded(dist.all_to_all_single)):
        hosted = dispatch(local, replace(check.domain, control=control), planner=_GivenPlan(plan))
    same = all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
               and torch.equal(a.loss_mask, b.loss_mask) for a, b in zip(plain.microbatches, hosted.microbatches))
    return {"same": same and len(plain.microbatches) == len(hosted.microbatches), "used": used}
