"""Functions the MoE tests run on every spawned rank (importable by name, results picklable)."""

from __future__ import annotations

import warnings
from datetime import timedelta

import torch.distributed as dist

from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.cpu_compat import apply_cpu_compat
from megatron_dhp.runtime.model import TinyGPTConfig
from megatron_dhp.runtime.selfcheck import SelfCheck, init_distributed, random_samples
from tests.runtime.dist_workers import SAMPLE_SEED, batch

DISPATCHERS = ("alltoall",)


def moe_config(dispatcher: str) -> TinyGPTConfig:
    """4 experts, top-2, no load-balancing loss: the loss does not depend on how tokens form microbatches."""
    return TinyGPTConfig(num_experts=4, moe_token_dispatcher=dispatcher)


def plans_of_four() -> dict[str, Plan]:
    """Plans on a domain of 4 where EP partners run different numbers of microbatches, in groups of 1 and 2."""
    b = batch().samples
    return {
        "1+1+2 then 2+2, counts 3/1/2/2": Plan("t", 4, 4, b, (
            PlanGroup((0,), ((0, 1), (2,), (3,))),
            PlanGroup((1,), ((4, 5, 6),)),
            PlanGroup((2, 3), ((7,), (8, 9))),
            PlanGroup((0, 1), ((10,),), phase=1),
            PlanGroup((2, 3), ((11,),), phase=1),
        )),
        "2 across EP groups + idle, barrier": Plan("t", 4, 4, b, (
            PlanGroup((1, 2), ((0, 3), (5,), (1, 2))),
            PlanGroup((0,), ((4,),)),
            PlanGroup((3,), (), phase=0),
            PlanGroup((0, 3), ((6, 7, 8),), phase=1),
            PlanGroup((1,), ((9,), (10,)), phase=1),
            PlanGroup((2,), ((11,),), phase=1),
        ), phase_barrier=True),
    }


def expert_parallel_checks() -> dict:
    """EP 2 on 4 ranks: every plan under both dispatchers, against the single-process oracle."""
    warnings.filterwarnings("ignore")
    apply_cpu_compat()
    init_distributed(expert_parallel=2, timeout=timedelta(seconds=60))
    out: dict = {"ep": {}, "exact": {}}
    for dispatcher in DISPATCHERS:
        check = SelfCheck(config=moe_config(dispatcher), seed=3)
        out["ep"][dispatcher] = check.model.config.expert_model_parallel_size
        samples = random_samples(batch(), vocab_size=check.config.vocab_size, seed=SAMPLE_SEED)
        for name, plan in plans_of_four().items():
            out["exact"][(dispatcher, name)] = check.check(plan, samples, "allgather")
    dist.destroy_process_group()
    return out
