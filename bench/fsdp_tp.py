"""Is tensor parallelism still needed with fully sharded data parallelism? dhp with FSDP at TP 1-8 against dhp
at the TP the distributed optimizer needs, on Llama-3-70B over 256 H100s (configs/llama3-70b-256.yaml), in
simulation.

Without FSDP the distributed optimizer shards only the fp32 master weights and Adam moments (12 bytes per
parameter) over the domain; the bf16 weights and fp32 gradients (6) stay per TP group, so the states fit
80 GB only at TP 8. With FSDP all 18 bytes shard over the 256 GPUs, so every TP fits and a GPU holds
3-27K tokens, but every microbatch slot all-gathers the weights twice and reduce-scatters the gradients
over the whole domain (3 x 2 bytes per parameter, 1 / t at TP t), in lockstep on every rank (`cost.fsdp`),
hidden under the slot's compute with `overlap_comm` (the preset's). dhp plans each layout's batches as it
would (it does not see the lockstep); each plan is then priced as it runs. The distributed optimizer's own
once-per-step reduce-scatter and all-gather are left out on both sides (overlapped with the last backward).

    python bench/fsdp_tp.py [--batches 3] [--bandwidths 20,50,100] [--workloads wlbllm,lognormal-pareto]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megatron_dhp.cost import CostConfig, CostModel, simulate
from megatron_dhp.cost.fsdp import lockstep_step, slot_traffic_s
from megatron_dhp.solver import run_planner
from megatron_dhp.solver.dhp import DhpPlanner
from megatron_dhp.solver.static_best import models
from megatron_dhp.workload import LengthSource

PARAMETERS = 70.6e9


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
