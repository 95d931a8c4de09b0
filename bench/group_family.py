"""Group family: dhp with and without the fixed family of groups, on WLB-LLM batches.

Per domain (the gpt7b-64 preset on N ranks, 8 per node, global batch 512): distinct multi-rank groups the
run used, the most groups one rank used, the group pool's LRU replayed over the steps (communicators
created and destroyed: cap 256 without the family, none after start-up with it), and dhp's step time with
the family over without (mean and max; target <= 1.01). Under the default `comm: mixed` dhp plans without
it and creates nothing after start-up either: the groups it used outside the family ran on the domain's
communicator (their count is a column). Then dhp's solve p50 with the family at 512 samples on 64 ranks
(target < 10 ms).

    python bench/group_family.py [--domains 64,256] [--steps 200] [--solve-batches 20]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megatron_dhp.cost import CostConfig, build_cost_model
from megatron_dhp.plan.family import DEFAULT_MAX_GROUPS_PER_RANK, group_family
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.workload import LengthSource


def replay_lru(steps: list[list[tuple[int, ...]]], cap: int) -> tuple[int, int]:
    """(created, destroyed) by `runtime.group_pool.GroupPool`'s rule over these steps' groups."""
    pool: OrderedDict[tuple[int, ...], None] = OrderedDict()
    created = destroyed = 0
    for needed in steps:
        for key in needed:
            if key in pool:
                pool.move_to_end(key)
            else:
                pool[key] = None
                created += 1
        while len(pool) > cap:
            pool.popitem(last=False)
            destroyed += 1
    return created, destroyed


def run_domain(n: int, args: argparse.Namespace, progress: Progress, task) -> dict:
    """dhp with (K = args.k) and without the family over `args.steps` batches on N = n."""
    model = build_cost_model(CostConfig.load("gpt7b-64").with_overrides(world_size=n))
    source = LengthSource.from_args(dist="wlbllm")
    family = group_family(n, model.domain.gpus_per_node, args.k)
    planner, families = build_planner("dhp"), {"family": family, "any": None}
    steps: dict[str, list[list[tuple[int, ...]]]] = {k: [] for k in families}
    times: dict[str, list[float]] = {k: [] for k in families}
    for k in range(args.steps):
        batch = source.draw(global_batch=512, seed=0, index=k, capacity=model.domain.capacity)
        for key, on in families.items():
            plan = run_planner(planner, batch, model, family=on)
            steps[key].append(list(plan.multi_rank_groups()))
            times[key].append(plan.predicted_step_time_s)
        progress.advance(task)
    row = {"n": n, "family_groups": len(family), "family_per_rank": family.max_membership}
    for key in families:
        used = {g for step in steps[key] for g in step}
        per_rank = np.zeros(n, dtype=np.int64)
        for g in used:
            per_rank[list(g)] += 1
        created, destroyed = replay_lru(steps[key], args.pool_cap)
        row[key] = {"distinct": len(used), "per_rank": int(per_rank.max()), "created": created, "destroyed": destroyed,
                    "outside": sum(not family.contains(g) for g in used)}
    ratio = np.array(times["family"]) / np.array(times["any"])
    row["ratio_mean"], row["ratio_max"] = float(ratio.mean()), float(ratio.max())
    return row


def solve_p50(batches: int, k: int) -> float:
    """dhp's solve p50 in ms with the family at 512 WLB-LLM samples on 64 ranks."""
    model = build_cost_model(CostConfig.load("gpt7b-64"))
    planner, family = build_planner("dhp"), group_family(64, model.domain.gpus_per_node, k)
    source = LengthSource.from_args(dist="wlbllm")
    return float(np.median([run_planner(planner, source.draw(global_batch=512, seed=1, index=i, capacity=model.domain.capacity),
                                        model, family=family).solve_time_ms for i in range(batches)]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--domains", default="64,256", help="comma-separated N (default 64,256)")
    p.add_argument("--steps", type=int, default=200, help="batches per domain (default 200)")
    p.add_argument("--k", type=int, default=DEFAULT_MAX_GROUPS_PER_RANK, help="max_groups_per_rank of the family")
    p.add_argument("--pool-cap", type=int, default=256, help="group pool cap without the family (default 256)")
    p.add_argument("--solve-batches", type=int, default=20, help="batches for the solve-time p50 (default 20)")
    args = p.parse_args()
    console = Console(width=220)
    domains = [int(x) for x in args.domains.split(",")]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(domains) * args.steps)
        rows = [run_domain(n, args, progress, task) for n in domains]
    table = Table(title=f"dhp with the group family (K = {args.k}) and without, {args.steps} WLB-LLM batches of 512")
    for col in ("N", "family groups", "family max/rank", "distinct used (any / family)", "max per rank used (any / family)",
                f"LRU creations / destructions (any, cap {args.pool_cap})",
                "family: created at start-up / after", "any: used outside the family (p2p under mixed)",
                "step family/any mean", "max"):
        table.add_column(col, justify="right")
    for r in rows:
        a, f = r["any"], r["family"]
        table.add_row(str(r["n"]), str(r["family_groups"]), str(r["family_per_rank"]), f"{a['distinct']} / {f['distinct']}",
                      f"{a['per_rank']} / {f['per_rank']}", f"{a['created']} / {a['destroyed']}", f"{r['family_groups']} / {f['outside']}",
                      str(a["outside"]), f"{r['ratio_mean']:.4f}", f"{r['ratio_max']:.4f}")
    console.print(table)
    console.print(f"dhp solve p50 with the family, 512 samples on 64 ranks: {solve_p50(args.solve_batches, args.k):.1f} ms "
                  "(target < 10 ms)", highlight=False)


if __name__ == "__main__":
    main()
