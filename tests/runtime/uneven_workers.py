"""Functions the uneven-shard tests run on every spawned rank (importable by name, results picklable).

Each launch shares one start-up across its checks; `test_uneven_shards.py` asserts on the returned values.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist

from megatron_dhp.models.gpt import TinyGPTConfig
from megatron_dhp.models.vlm import TinyVLMConfig, random_vlm_samples
from megatron_dhp.plan.comm import COMM_VARIANTS
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.attention.comm import PeerRing
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.core_attention import dynamic_cp_attention
from megatron_dhp.runtime.attention.meta import AttentionMeta
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.testing.host_sync import HostSyncError, NoHostSync
from megatron_dhp.verify.selfcheck import random_samples
from tests.numerics import RelativeSelfCheck
from tests.ranks import start_cpu_rank
from tests.runtime.dist_workers import SAMPLE_SEED, batch
from tests.runtime.moe_workers import ALLGATHER

SHARE_SEED = 44


def random_shares(ranks: tuple[int, ...], rng: random.Random) -> tuple[int, ...]:
    """Shares of 1 to 5 per rank, not all equal (a plan stores equal ones as none)."""
    while True:
        shares = tuple(rng.randint(1, 5) for _ in ranks)
        if len(set(shares)) > 1:
            return shares


def plans_of_four(seed: int = SHARE_SEED) -> dict[str, Plan]:
    """Plans on a domain of 4 with uneven groups of 2, 3 and 4 ranks (listed unsorted), seeded random shares."""
    rng = random.Random(seed)
    b = batch().samples

    def group(ranks, microbatches, phase=0):
        return PlanGroup(ranks, microbatches, phase, random_shares(ranks, rng))

    return {
        "2+2 non-contiguous, then 4": Plan("t", 4, 4, b, (
            group((2, 0), ((0, 3), (5,))),
            group((3, 1), ((1, 2, 4),)),
            group((1, 3, 0, 2), ((6, 7, 8, 9), (10, 11)), phase=1),
        )),
        "3 + 1, then 2 + 2, barrier": Plan("t", 4, 4, b, (
            group((3, 0, 2), ((0, 1, 2), (3,), (4, 5))),
            PlanGroup((1,), ((6, 7), (8,))),
            group((0, 1), ((9, 10),), phase=1),
            group((2, 3), ((11,),), phase=1),
        ), phase_barrier=True),
    }


def missized_plan() -> Plan:
    """A group of 3 (group ranks 1 and 2 hold different shares) and one rank alone: `missized` swaps the
    shares of group ranks 1 and 2, which changes neither rank 0's chunks nor any sample's padded length."""
    b = batch().samples
    return Plan("t", 4, 4, b, (
        PlanGroup((0, 1, 2), ((0, 1, 2, 3), (4, 5, 6), (7, 8)), shares=(2, 1, 4)),
        PlanGroup((3,), ((9, 10, 11),)),
    ))


def missized(layout: MicrobatchLayout) -> MicrobatchLayout:
    """`layout` as a rank that mistakes the shares of group ranks 1 and 2 for each other sees it."""
    if not layout.uneven:
        return layout
    shares = list(layout.shares)
    shares[1], shares[2] = shares[2], shares[1]
    return replace(layout, shares=tuple(shares))


def uneven_checks() -> dict:
    """EP 2 on 4 ranks (a domain of 4): every comm variant on uneven groups of 2, 3 and 4 ranks against one
    process, with Ulysses' heads fewer than a group's ranks, MoE's allgather dispatcher (equal slot rows),
    a vision-language model, multi-token prediction; a rank that mis-sizes the shares; a layer of each
    variant under `NoHostSync`."""
    start_cpu_rank(expert_parallel=2)
    check = RelativeSelfCheck(seed=5)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    plans = plans_of_four()
    out: dict = {"shares": {name: [g.shares for g in plan.groups] for name, plan in plans.items()}}
    out["exact"] = {(name, comm): check.check(plan, samples, comm) for name, plan in plans.items()
                    for comm in COMM_VARIANTS}
    two_heads = RelativeSelfCheck(config=TinyGPTConfig(hidden_size=32, num_attention_heads=2, num_query_groups=1), seed=6)
    out["two_heads"] = two_heads.check(plans["3 + 1, then 2 + 2, barrier"], samples, "ulysses")
    moe = RelativeSelfCheck(config=ALLGATHER, seed=3)
    out["moe_allgather"] = {name: moe.check(plan, samples, "ring") for name, plan in plans.items()}
    mtp = RelativeSelfCheck(config=TinyGPTConfig(mtp_num_layers=1), seed=4)
    out["mtp"] = mtp.check(plans["2+2 non-contiguous, then 4"], samples, "p2p")
    vlm_config = TinyVLMConfig()
    vlm = RelativeSelfCheck(vlm=vlm_config, seed=11)
    images = random_vlm_samples(batch(), vlm_config, seed=11)
    out["vlm"] = {placement: vlm.check(plans["3 + 1, then 2 + 2, barrier"], images, "allgather", placement=placement)
                  for placement in ("split", "global")}

    out["missized_exact"] = check.check(missized_plan(), samples, "ulysses")
    build = AttentionMeta.build.__func__
    wrong = classmethod(lambda cls, layout, device="cpu": build(cls, missized(layout), device))
    with mock.patch.object(AttentionMeta, "build", wrong) if check.domain.position == 0 else contextlib.nullcontext():
        out["missized"] = check.check(missized_plan(), samples, "ulysses")
    out["host_syncs"] = layers_without_host_sync()
    return out


def layers_without_host_sync() -> dict[str, str | None]:
    """Per variant: None, or the first host-syncing operation of two layers' forward and backward on a group of
    the whole world with uneven shares (the layout and its metadata built outside, once per microbatch)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    layout = MicrobatchLayout((0, 1, 2), (37, 2, 90), size, rank, shares=(3, 1, 4, 2)[:size])
    out: dict[str, str | None] = {}
    for comm in COMM_VARIANTS:
        ring = PeerRing(tuple(range(size)), rank, None) if comm == "p2p" else group
        ctx = CPContext(layout, ring, comm)
        q, k, v = (torch.randn(layout.num_slots, n, 16, requires_grad=True) for n in (4, 2, 2))
        try:
            with NoHostSync():
                for _ in range(2):
                    dynamic_cp_attention(q, k, v, ctx, 0.25).sum().backward()
            out[comm] = None
        except HostSyncError as e:
            out[comm] = str(e)
    return out


def sequence_parallel_checks() -> dict:
    """TP 2 + SP on 4 ranks (two domains of 2): every variant on uneven groups of 2 against one process."""
    start_cpu_rank(tensor_parallel=2)
    check = RelativeSelfCheck(config=TinyGPTConfig(sequence_parallel=True), seed=7)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    plan = plan_of_two()
    out = {"sp": (check.model.config.tensor_model_parallel_size, check.model.config.sequence_parallel),
           "exact": {comm: check.check(plan, samples, comm) for comm in COMM_VARIANTS}}
    return out


def plan_of_two() -> Plan:
    """A domain of 2: ranks alone, then a group of both with shares 1:3, then 5:2 over odd lengths."""
    b = batch().samples
    return Plan("t", 2, 2, b, (
        PlanGroup((0,), ((0, 1, 2), (3,))),
        PlanGroup((1,), ((4, 5, 6),)),
        PlanGroup((1, 0), ((7, 8), (9,)), phase=1, shares=(3, 1)),
        PlanGroup((0, 1), ((10, 11),), phase=2, shares=(5, 2)),
    ))


def pipeline_checks() -> dict:
    """PP 2 on 4 ranks (a domain of 2): uneven groups through megatron-core's 1F1B, ring and allgather."""
    start_cpu_rank(pipeline_parallel=2)
    check = RelativeSelfCheck(seed=5)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    out = {"exact": {comm: check.check(plan_of_two(), samples, comm) for comm in ("ring", "allgather")}}
    return out
