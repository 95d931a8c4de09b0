"""Is tensor parallelism still needed with fully sharded data parallelism? dhp with FSDP at TP 1-8 against dhp
at the TP the distributed optimizer needs, on Llama-3-70B over 256 H100s (configs/llama3-70b-256.yaml), in
simulation.

Without FSDP the distributed optimizer shards only the fp32 master weights and Adam moments (12 bytes per
parameter) over the domain; the bf16 weights and fp32 gradients (6) stay per TP group, so the states fit
80 GB only at TP 8. With FSDP all 18 bytes shard over the 256 GPUs, so every TP fits and a GPU holds
3-27K tokens, but every microbatch slot all-gathers the weights twice and reduce-scatters the gradients
over the whole domain (3 x 2 bytes per parameter, 1 / t at TP t), in lockstep on every rank, hidden under
the slot's compute with `overlap_comm` (the preset's). dhp plans each layout's batches as it would (it does
not see the lockstep); each plan is then priced as it runs. The distributed optimizer's own once-per-step
reduce-scatter and all-gather are left out on both sides (overlapped with the last backward).

Lockstep slots (`lockstep_step`; the cost model's `simulate` and the planners do not price them): with FSDP
(Megatron-FSDP, torch FSDP2, ZeRO-3) every microbatch all-gathers the weights for its forward and again for
its backward and reduce-scatters its gradients, layer by layer, over all the domain's ranks, whatever CP
group the microbatch runs on. So the k-th microbatch slot of a phase is a collective step of every rank (the
runtime aligns the slots under FSDP as under expert parallelism, `runtime.slots`): the domain runs slot by
slot, each slot as long as its slowest rank's microbatch (an idle rank still joins), and the parameter
traffic of a slot, G (n - 1) / n / bw (G = the cost config's `fsdp_gather_bytes`, n positions, the
inter-node bandwidth once the domain spans nodes), is hidden under that microbatch with `overlap_comm`
(layer-wise prefetch) or added to it.

    python bench/fsdp_tp.py [--batches 3] [--bandwidths 20,50,100] [--workloads wlbllm,lognormal-pareto]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megatron_dhp.cost import CostConfig, CostModel, simulate
from megatron_dhp.cost.simulate import PlanTimes
from megatron_dhp.plan.plan import Plan
from megatron_dhp.solver import run_planner
from megatron_dhp.solver.dhp import DhpPlanner
from megatron_dhp.solver.static_best import models
from megatron_dhp.workload import LengthSource

PARAMETERS = 70.6e9


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


def fsdp(config: CostConfig) -> CostConfig:
    """The config with all 18 bytes of state per parameter sharded over the domain and FSDP's per-slot traffic."""
    return replace(config, model_state_bytes=0.0, sharded_state_bytes=18 * PARAMETERS,
                   fsdp_gather_bytes=3 * 2 * PARAMETERS)


def layouts(base: CostConfig) -> list[tuple[str, CostConfig, CostModel]]:
    """Every (FSDP or not, TP) layout whose states fit the budget, with its cost model (`static_best.models`)."""
    return [(f"{name}, TP {t}", replace(config, tensor_parallel=t), model)
            for name, config in (("distributed optimizer", base), ("FSDP", fsdp(base)))
            for t, model in models(config).items()]


def step_s(config: CostConfig, model: CostModel, batch) -> tuple[float, float, int]:
    """dhp's step on the batch under the layout (in lockstep slots with FSDP), the same plan run as without
    FSDP (each group as soon as its ranks are free, no traffic), and the position's token cap."""
    plan = run_planner(DhpPlanner(), batch, model)
    free = simulate(plan, model).step_time_s
    if not config.fsdp_gather_bytes:
        return free, free, model.domain.max_tokens_per_rank
    step = lockstep_step(plan, model, slot_traffic_s(model.config), config.overlap_comm)
    return step, free, model.domain.max_tokens_per_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=3, help="batches of 512 per workload (default 3)")
    parser.add_argument("--bandwidths", default="20,50,100", help="inter-node GB/s per GPU to try (default 20,50,100)")
    parser.add_argument("--workloads", default="wlbllm,lognormal-pareto")
    args = parser.parse_args()
    base = CostConfig.load("llama3-70b-256")
    console = Console(width=160)
    table = Table(title=f"Llama-3-70B, 256 H100s, dhp: mean step over {args.batches} batches of 512 (s)")
    for col in ("inter-node GB/s", "workload", "layout", "tokens per position", "step s", "same plan unlocked s", "vs best"):
        table.add_column(col, justify="right")
    bandwidths = [float(b) for b in args.bandwidths.split(",")]
    workloads = args.workloads.split(",")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(bandwidths) * len(workloads))
        for bw in bandwidths:
            linked = replace(base, inter_node_bytes_per_s=bw * 1e9)
            for workload in workloads:
                source = LengthSource.from_args(dist=workload)
                batches = [source.draw(global_batch=512, seed=0, index=k, capacity=10**9) for k in range(args.batches)]
                rows = []
                for name, config, model in layouts(linked):
                    results = np.array([step_s(config, model, b) for b in batches])
                    rows.append((name, int(results[0, 2]), *results[:, :2].mean(axis=0).tolist()))
                best = min(row[2] for row in rows)
                for name, cap, step, free in rows:
                    table.add_row(f"{bw:g}", workload, name, f"{cap:,}", f"{step:.2f}", f"{free:.2f}", f"{step / best:.2f}x")
                progress.advance(task)
    console.print(table)


if __name__ == "__main__":
    main()
