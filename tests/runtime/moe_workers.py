"""Functions the MoE tests run on every spawned rank (importable by name, results picklable)."""

from __future__ import annotations

from dataclasses import replace

from megatron.core import parallel_state

from megatron_dhp.models.gpt import TinyGPTConfig, global_names
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.verify.selfcheck import random_samples
from tests.numerics import RelativeSelfCheck
from tests.ranks import start_cpu_rank
from tests.runtime.dist_workers import SAMPLE_SEED, batch

MOE = TinyGPTConfig(num_experts=4)
"""4 experts, top-2, alltoall, no load-balancing loss: the loss does not depend on how tokens form microbatches."""
ALLGATHER = replace(MOE, moe_token_dispatcher="allgather")
"""The same with megatron-core's allgather dispatcher (equal token blocks over TP x EP: equal slot rows)."""


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


def rounded_rows_of_four() -> Plan:
    """A plan on 4 whose slot 0 holds 7, 1, 2 and 2 rows (a pair next to an odd maximum: every rank pads to 8,
    the pair's shards by 6 rows each), then a phase where one position alone runs a second slot."""
    b = batch().samples
    return Plan("t", 4, 4, b, (
        PlanGroup((0,), ((0,), (1,))),
        PlanGroup((1,), ((5,),)),
        PlanGroup((2, 3), ((2,), (3, 4))),
        PlanGroup((0, 2), ((6, 7),), phase=1),
        PlanGroup((1,), ((8,), (9,)), phase=1),
        PlanGroup((3,), ((10, 11),), phase=1),
    ))


def plans_of_two() -> dict[str, Plan]:
    """Plans on a domain of 2 (one EP group) whose two positions run microbatches of different lengths and
    counts in one slot, and a CP group of both."""
    b = batch().samples
    return {
        "1+1, counts 2/3, then 2": Plan("t", 2, 2, b, (
            PlanGroup((0,), ((0, 1), (2,))),
            PlanGroup((1,), ((3,), (4, 5), (6,))),
            PlanGroup((0, 1), ((7, 8), (9, 10, 11)), phase=1),
        )),
        "2 then 1 + idle, barrier": Plan("t", 2, 2, b, (
            PlanGroup((0, 1), ((0, 3), (5,), (1, 2, 4))),
            PlanGroup((0,), ((6, 7, 8, 9, 10, 11),), phase=1),
            PlanGroup((1,), (), phase=1),
        ), phase_barrier=True),
    }


def one_sample_per_microbatch() -> Plan:
    """Every microbatch one whole sample on a group of 1, three per position: no idle slot, so a router's
    load-balancing loss sees the same tokens per microbatch as the oracle's per-sample runs."""
    b = batch().samples
    return Plan("t", 4, 4, b, tuple(PlanGroup((r,), tuple((s,) for s in range(r, 12, 4))) for r in range(4)))


def expert_parallel_checks() -> dict:
    """EP 2 on 4 ranks: alltoall and allgather exactness per plan, the load-balancing loss."""
    start_cpu_rank(expert_parallel=2)
    check = RelativeSelfCheck(config=MOE, seed=3)
    samples = random_samples(batch(), vocab_size=MOE.vocab_size, seed=SAMPLE_SEED)
    out: dict = {"ep": check.model.config.expert_model_parallel_size,
                 "experts": sorted(n for n in global_names(check.model).values() if "local_experts" in n)}
    out["exact"] = {name: check.check(plan, samples, "allgather") for name, plan in plans_of_four().items()}
    out["exact"]["ulysses"] = check.check(plans_of_four()["2 across EP groups + idle, barrier"], samples, "ulysses")

    aux = RelativeSelfCheck(config=replace(MOE, moe_aux_loss_coeff=0.1), seed=3)
    out["aux"] = aux.check(one_sample_per_microbatch(), samples, "allgather")
    out["aux_split"] = aux.check(plans_of_four()["1+1+2 then 2+2, counts 3/1/2/2"], samples, "allgather")

    gather = RelativeSelfCheck(config=ALLGATHER, seed=3)
    plans = {**plans_of_four(), "rounded rows": rounded_rows_of_four()}
    out["allgather"] = {name: gather.check(plan, samples, "allgather") for name, plan in plans.items()}
    out["allgather"]["ulysses"] = gather.check(plans_of_four()["2 across EP groups + idle, barrier"], samples, "ulysses")
    return out


def allgather_checks(tensor_parallel: int = 1) -> dict:
    """EP 2 with the allgather dispatcher over a domain of 2 (2 ranks; with TP 2 and SP, 4 ranks)."""
    start_cpu_rank(tensor_parallel=tensor_parallel, expert_parallel=2)
    check = RelativeSelfCheck(config=replace(ALLGATHER, sequence_parallel=tensor_parallel > 1), seed=5)
    samples = random_samples(batch(), vocab_size=MOE.vocab_size, seed=SAMPLE_SEED)
    config = check.model.config
    out: dict = {"ep": config.expert_model_parallel_size, "sp": config.sequence_parallel, "domain": check.domain.size,
                 "tp_ep": parallel_state.get_expert_tensor_and_model_parallel_world_size()}
    out["exact"] = {name: check.check(plan, samples, "allgather") for name, plan in plans_of_two().items()}
    return out
