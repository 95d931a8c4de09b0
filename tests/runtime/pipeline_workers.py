"""Functions the pipeline-parallel tests run on every spawned rank (importable by name, results picklable)."""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.models.gpt import TinyGPTConfig
from megatron_dhp.plan.comm import COMM_VARIANTS
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.step_data import local_slice
from megatron_dhp.testing.dispatch import dispatch
from megatron_dhp.verify.selfcheck import random_samples
from tests.numerics import RelativeSelfCheck
from tests.ranks import start_cpu_rank
from tests.runtime.dist_workers import SAMPLE_SEED, batch


def plans_of_two() -> dict[str, Plan]:
    """Plans on a domain of 2 whose 1F1B slot lists differ per position (idle slots, different counts)."""
    b = batch().samples
    return {
        # naive back-to-back lists would be [g, h] vs [g, b1, h]: F(h) meets B(g) and both hang
        "naive deadlock [g, h] vs [g, b1, h]": Plan("t", 2, 2, b, (
            PlanGroup((0, 1), ((0, 1, 2),)),
            PlanGroup((1,), ((3, 4),), phase=1),
            PlanGroup((0,), (), phase=1),
            PlanGroup((0, 1), ((5, 6, 7, 8, 9, 10, 11),), phase=2),
        )),
        "idle slot, then 2 vs 4 slots in the last phase": Plan("t", 2, 2, b, (
            PlanGroup((0,), ((0, 1), (2,))),
            PlanGroup((1,), ((3,),)),
            PlanGroup((0, 1), ((4, 5, 6), (7,)), phase=1),
            PlanGroup((0,), ((8,), (9,), (10,)), phase=2),
            PlanGroup((1,), ((11,),), phase=2),
        )),
        "one group of 2, three microbatches, barrier": Plan("t", 2, 2, b, (
            PlanGroup((0, 1), ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))),
        ), phase_barrier=True),
    }


def comms_of(name: str) -> list[str]:
    """The comm variants a plan of `plans_of_two` runs with (every variant is used, the plans alternate)."""
    k = list(plans_of_two()).index(name)
    return list(COMM_VARIANTS)[k % 2::2]


def pipeline_two_checks() -> dict:
    """PP 2 x domain 2 on 4 ranks: exactness per plan and comm variant, divergent plans stop every rank."""
    start_cpu_rank(pipeline_parallel=2)
    check = RelativeSelfCheck(seed=5)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    plans = plans_of_two()
    out: dict = {"rank": dist.get_rank(), "domain": check.domain.global_ranks}
    out["exact"] = {(name, comm): check.check(plan, samples, comm)
                    for name, plan in plans.items() for comm in comms_of(name)}
    first = plans["naive deadlock [g, h] vs [g, b1, h]"]
    other = replace(first, groups=(replace(first.groups[0], microbatches=((0, 1), (2,))), *first.groups[1:]))
    try:  # the last stage holds another plan than the first: every rank stops, none hangs
        dispatch(local_slice(samples, check.domain.position, 2), check.domain,
                 plan=other if dist.get_rank() == 3 else first)
        out["divergent"] = "no error"
    except DhpError as e:
        out["divergent"] = str(e)
    out["after_errors"] = check.check(first, samples, "ring")
    tied = RelativeSelfCheck(seed=9, tied_embeddings=True)
    out["tied"] = {name: tied.check(plan, samples, "allgather") for name, plan in plans.items()}
    return out


def plans_of_three() -> dict[str, Plan]:
    """Plans on a domain of 3 (not a power of two) with group sizes 1, 2 and 3, idle slots, uneven counts."""
    b = batch().samples
    return {
        "3, then 2+1, then 1+2": Plan("t", 3, 3, b, (
            PlanGroup((0, 1, 2), ((0, 1, 2, 3),)),
            PlanGroup((2, 0), ((4, 5), (6,)), phase=1),
            PlanGroup((1,), ((7,),), phase=1),
            PlanGroup((0,), ((8,), (9,)), phase=2),
            PlanGroup((1, 2), ((10, 11),), phase=2),
        )),
    }


def pipeline_three_checks() -> dict:
    """PP 2 x domain 3 on 6 ranks: one plan under every comm variant."""
    start_cpu_rank(pipeline_parallel=2)
    check = RelativeSelfCheck(seed=8)
    samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
    out = {"domain": check.domain.global_ranks,
           "exact": {(name, comm): check.check(plan, samples, comm)
                     for name, plan in plans_of_three().items() for comm in COMM_VARIANTS}}
    return out


def interleaved_checks() -> dict:
    """PP 2 x VPP 2 x domain 2 on 4 ranks (4 layers, one per chunk): the plans of two under megatron-core's
    interleaved 1F1B, tied embeddings too, and a plan of the wrong interleaving refused on every rank."""
    start_cpu_rank(pipeline_parallel=2, virtual_pipeline=2)
    config = TinyGPTConfig(num_layers=4)
    plans = {name: replace(plan, pipeline_stages=2, virtual_stages=2) for name, plan in plans_of_two().items()}
    out: dict = {"exact": {}, "tied": {}}
    for tied in (False, True):
        check = RelativeSelfCheck(config=config, seed=11, tied_embeddings=tied, virtual=2)
        samples = random_samples(batch(), vocab_size=config.vocab_size, seed=SAMPLE_SEED)
        for name, plan in plans.items():
            for comm in comms_of(name)[:1 if tied else None]:
                out["tied" if tied else "exact"][(name, comm)] = check.check(plan, samples, comm)
    try:
        check.check(plans_of_two()["one group of 2, three microbatches, barrier"], samples, "allgather")
        out["wrong"] = "no error"
    except DhpError as e:
        out["wrong"] = str(e)
    return out


def interleaved_with_a_wrong_receive_order() -> dict:
    """`interleaved_checks`' first plan with `PlannedShapes` reading the rows in non-interleaved slot order."""
    from megatron_dhp.runtime import pipeline

    pipeline.chunk_table = lambda num_slots, stages, virtual: [(j, c) for j in range(num_slots) for c in range(virtual)]
    start_cpu_rank(pipeline_parallel=2, virtual_pipeline=2)
    config = TinyGPTConfig(num_layers=4)
    check = RelativeSelfCheck(config=config, seed=11, virtual=2)
    plan = replace(next(iter(plans_of_two().values())), pipeline_stages=2, virtual_stages=2)
    return {"ok": check.check(plan, random_samples(batch(), vocab_size=config.vocab_size, seed=SAMPLE_SEED), "ring").ok}


def tensor_and_pipeline_checks() -> dict:
    """TP 2 x PP 2 on 4 ranks (a domain of 1 per coordinate): two microbatches, tied and untied embeddings."""
    start_cpu_rank(tensor_parallel=2, pipeline_parallel=2)
    plan = Plan("t", 1, 1, batch().samples, (PlanGroup((0,), ((0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10, 11))),))
    out = {}
    for tied in (False, True):
        check = RelativeSelfCheck(seed=10, tied_embeddings=tied)
        samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
        out[tied] = check.check(plan, samples, "allgather")
    # sequence parallelism: the stages exchange each TP rank's half of the (padded) rows
    sp = RelativeSelfCheck(config=TinyGPTConfig(sequence_parallel=True), seed=10)
    out["sp"] = sp.check(plan, random_samples(batch(), vocab_size=sp.config.vocab_size, seed=SAMPLE_SEED), "allgather")
    return out
