"""Fully sharded data parallelism under dynamic groups: every microbatch slot is a collective of the whole
domain.

With FSDP (Megatron-FSDP, torch FSDP2, ZeRO-3) the domain shards the weights, and every microbatch
all-gathers them for its forward and again for its backward and reduce-scatters its gradients, layer by
layer, over all the domain's ranks, whatever CP group the microbatch runs on. So the k-th microbatch slot
of a phase is a collective step of every rank (as the runtime already pads slots for MoE's expert-parallel
dispatcher, `runtime.slots`): the domain runs in lockstep, slot by slot, each slot as long as its slowest
rank's microbatch (an idle rank still joins), and the parameter traffic of a slot,
G (n - 1) / n / bw (G = `fsdp_gather_bytes`, n positions, the inter-node bandwidth once the domain spans
nodes), is hidden under that microbatch with `overlap_comm` (layer-wise prefetch) or added to it.

Pure: prices a plan from its groups and the model's microbatch times (`simulate.PlanTimes`).
"""

from __future__ import annotations

from collections import defaultdict

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.cost.model import CostModel
from megatron_dhp.cost.simulate import PlanTimes
from megatron_dhp.plan.plan import Plan


def slot_traffic_s(config: CostConfig) -> float:
    """Seconds of one slot's parameter gathers and gradient scatter on a position's config (per_position's:
    at TP t its G is already 1 / t): G (n - 1) / n over the domain's links."""
    n = config.world_size
    bw = config.intra_node_bytes_per_s if n <= config.gpus_per_node else config.inter_node_bytes_per_s
    return config.fsdp_gather_bytes * (n - 1) / n / bw


def lockstep_step(plan: Plan, model: CostModel, traffic_s: float, overlap: bool) -> float:
    """The plan's step when every microbatch slot is a collective of the whole domain: phase by phase, slot
    k lasts the longest k-th microbatch any rank runs in the phase, with `traffic_s` hidden under it
    (`overlap`) or added, plus the step overhead (single-stage plans)."""
    if plan.pipeline_stages > 1:
        raise ValueError("lockstep_step prices single-stage plans")
    times = PlanTimes(plan, model).microbatch_times()
    slots: dict[int, list[float]] = defaultdict(list)  # per phase: the longest k-th microbatch so far
    for gi, group in enumerate(plan.groups):
        longest = slots[group.phase]
        for k, t in enumerate(times[gi]):
            if k == len(longest):
                longest.append(t)
            else:
                longest[k] = max(longest[k], t)
    total = sum(max(t, traffic_s) if overlap else t + traffic_s for phase in slots.values() for t in phase)
    return model.step_overhead_s + total
