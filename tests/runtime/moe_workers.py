"""Functions the MoE tests run on every spawned rank (importable by name, results picklable)."""

from __future__ import annotations

import warnings
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.cpu_compat import apply_cpu_compat
from megatron_dhp.runtime.model import TinyGPTConfig, global_names
from megatron_dhp.runtime.selfcheck import SelfCheck, init_distributed, random_samples
from tests.runtime.dist_workers import SAMPLE_SEED, batch

MOE = TinyGPTConfig(num_experts=4)
"""4 experts, top-2, alltoall, no load-balancing loss: the loss does not depend on how tokens form microbatches."""


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


def one_sample_per_microbatch() -> Plan:
    """Every microbatch one whole sample on a group of 1, three per position: no idle slot, so a router's
    load-balancing loss sees the same tokens per microbatch as the oracle's per-sample runs."""
    b = batch().samples
    return Plan("t", 4, 4, b, tuple(PlanGroup((r,), tuple((s,) for s in range(r, 12, 4))) for r in range(4)))


def expert_parallel_checks() -> dict:
    """EP 2 on 4 ranks: alltoall exactness per plan, the load-balancing loss, the allgather refusal."""
    warnings.filterwarnings("ignore")
    apply_cpu_compat()
    init_distributed(expert_parallel=2, timeout=timedelta(seconds=60))
    check = SelfCheck(config=MOE, seed=3)
    samples = random_samples(batch(), vocab_size=MOE.vocab_size, seed=SAMPLE_SEED)
    out: dict = {"ep": check.model.config.expert_model_parallel_size,
                 "experts": sorted(n for n in global_names(check.model).values() if "local_experts" in n)}
    out["exact"] = {name: check.check(plan, samples, "allgather") for name, plan in plans_of_four().items()}
    out["exact"]["ulysses"] = check.check(plans_of_four()["2 across EP groups + idle, barrier"], samples, "ulysses")

    aux = SelfCheck(config=replace(MOE, moe_aux_loss_coeff=0.1), seed=3)
    out["aux"] = aux.check(one_sample_per_microbatch(), samples, "allgather")
    out["aux_split"] = aux.check(plans_of_four()["1+1+2 then 2+2, counts 3/1/2/2"], samples, "allgather")
    try:
        SelfCheck(config=replace(MOE, moe_token_dispatcher="allgather"), seed=3)
        out["allgather"] = "no error"
    except DhpError as e:
        out["allgather"] = str(e)
    dist.destroy_process_group()
    return out
