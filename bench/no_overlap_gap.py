"""Is the no-overlap gap the bound's or the planner's? dhp's step against two bounds and a witness plan.

For the cost-model variants "reference" and "no overlap" (`plan_quality.VARIANTS`, gpt7b-64), on the shipped
workloads (`plan_quality.WORKLOADS`) and on a long-context batch, per batch:

- dhp's simulated step over the best bound (`cost.bound.best_lower_bound`) and over the new bound, the larger
  of that and `cost.forced_comm.forced_width_lower_bound` (samples forced onto wide groups, weighed by width);
- a witness: the best of `--tries` list schedules of the same samples (each sample that needs several ranks on
  exactly that many, the ranks free earliest, in one node where it fits one unless across nodes ends it
  sooner; the waits and the end filled with the one-rank samples), a valid plan scored by the same simulator.
  Where it beats dhp, the planner is provably loose by that much; where the new bound rises above the best
  one, the best bound was provably loose by that much; what is left between them is open.

The long-context batches (in the spirit of ProLong-64K, whose lengths are not in the repository): the
bimodal generator with 5 % documents of 32K-128K tokens among 128-4K ones (`LONG_CONTEXT`: 61-70 % of the
tokens in the long ones, which need 4 to 16 ranks of M = 8,192; 2.6-3.5M tokens a batch of 512), and with 3 %
of 32K-256K (`LONG_256K`: up to 32 ranks a document, 3-4M tokens a batch). `--ranks` plans them on domains of
other sizes (the model's world size overridden). Every planner is scored against the bounds of the same
samples. The last lines say whether dhp is within 3 % of the best provable bound on average over the
shipped workloads, within 2 % over the long-context rows and how far behind the best of the witness and
the peers it is on its worst batch, and how the gap is settled: (a) a tighter bound, or (b) a looser planner.

    python bench/no_overlap_gap.py [--batches 3] [--tries 200] [--planners dhp,fcp-ref] [--json out.json]
    python bench/no_overlap_gap.py --workloads long-context,long-context-256k --ranks 64,256 --seed 1

The measured tables are on docs/results.md ("Long-context plans").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

import numpy as np
from plan_quality import VARIANT_BASE, VARIANTS, WORKLOADS, planning_family  # bench/ is sys.path[0]
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megatron_dhp.cli.common import dataset_max_tokens
from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.cost.bound import best_lower_bound
from megatron_dhp.cost.forced_comm import forced_width_lower_bound
from megatron_dhp.plan.plan import Plan, PlanGroup, memory_fields
from megatron_dhp.solver import PLANNERS, PlannerContext, PlannerUnsupported, build_planner, run_planner
from megatron_dhp.workload import LengthSource, get_distribution

LONG_CONTEXT = dataclasses.replace(
    get_distribution("bimodal"), name="long-context",
    description="5% documents of 32K-128K tokens among 128-4K ones (two thirds of the tokens long)",
    params=dict(long_prob=0.05, short=(128, 4096), long=(32768, 131072)))
LONG_256K = dataclasses.replace(
    LONG_CONTEXT, name="long-context-256k",
    description="3% documents of 32K-256K tokens among 128-4K ones (3-4M tokens a batch of 512)",
    params=dict(long_prob=0.03, short=(128, 4096), long=(32768, 262144)))
LONG_WORKLOADS = {w.name: w for w in (LONG_CONTEXT, LONG_256K)}
CASES = ("reference", "no overlap")
TARGET = 1.03
LONG_TARGET = 1.02
TIGHT = 0.005
"""A gap below this fraction of the bound is called tight."""


# ---------------------------------------------------------------- the witness: list schedules
def witness_plan(batch, model, *, tries: int, seed: int = 0) -> Plan:
    """The shortest of `tries` list schedules (the module docstring), as a validated plan: the multi-rank
    samples longest, slowest or largest in area first, and after those three in the same orders by randomly
    perturbed keys."""
    lo = model.footprint(batch.samples).min_degree()
    wide = np.flatnonzero(lo > 1)
    seconds = model.sample_time(batch.lengths[wide].astype(np.float64), model.sample_work(batch.samples)[wide],
                                lo[wide], lo[wide] <= model.domain.gpus_per_node)
    orders = (batch.lengths[wide], seconds, lo[wide] * seconds)  # longest, slowest, largest area first
    rng = random.Random(seed)
    best = None
    for k in range(tries):
        noise = np.array([1.0 + (0.3 * rng.random() if k >= len(orders) else 0.0) for _ in wide])
        key = orders[k % len(orders)] * noise
        found = list_schedule(batch, model, wide[np.argsort(-key, kind="stable")].tolist())
        best = found if best is None or found[0] < best[0] else best
    domain = model.domain
    groups = [PlanGroup(ranks, tuple(tuple(batch.samples[i].id for i in mb) for mb in mbs), phase + 1)
              for phase, (_, ranks, mbs) in enumerate(sorted(best[1], key=lambda e: e[0]))]
    idle = sorted(set(range(domain.world_size)) - {r for g in groups for r in g.ranks})
    groups += [PlanGroup((r,), (), 0) for r in idle]
    plan = Plan("witness", domain.world_size, domain.gpus_per_node, batch.samples, tuple(groups),
                max_tokens_per_rank=domain.max_tokens_per_rank, **memory_fields(model.memory_rule()))
    plan.validate()
    return plan


def list_schedule(batch, model, order: list[int]) -> tuple[float, list[tuple[float, tuple[int, ...], list]]]:
    """One list schedule: the wide samples in `order`, each on its fewest ranks where it ends first, then the
    one-rank samples longest first into the waits and onto the least loaded ranks. Its makespan and its
    groups as (start, ranks, microbatches of sample indices)."""
    n, g, m = model.domain.world_size, model.domain.gpus_per_node, model.microbatch_overhead(1)
    tokens = batch.lengths.astype(np.float64)
    work = model.sample_work(batch.samples)
    footprint = model.footprint(batch.samples)
    lo = footprint.min_degree()
    t_in, t_out = (model.sample_time(tokens, work, lo, intra) for intra in (True, False))
    free = np.zeros(n)
    entries, waits = [], []
    for j in order:
        d = int(lo[j])
        ranks = np.argsort(free, kind="stable")[:d]  # the d ranks free first, wherever they are
        options = [(free[ranks].max() + (t_in if model.is_intra(ranks) else t_out)[j], ranks)]
        if d <= g:  # or the d free first of one node, at the intra-node bandwidth
            for node in range(0, n - d + 1, g):
                own = node + np.argsort(free[node:node + g], kind="stable")[:d]
                options.append((free[own].max() + t_in[j], own))
        end, ranks = min(options, key=lambda o: (o[0], float((free[o[1]].max() - free[o[1]]).sum())))  # then least wait
        start = end - (t_in[j] if model.is_intra(ranks) else t_out[j])
        waits += [(int(r), float(free[r]), start) for r in ranks if free[r] < start]
        entries.append((start, tuple(sorted(int(r) for r in ranks)), [[j]]))
        free[ranks] = end + model.microbatch_overhead(d)  # its one microbatch's overhead
    one = sorted(np.flatnonzero(lo <= 1).tolist(), key=lambda j: -t_in[j])
    load = footprint.load(np.arange(len(tokens)), 1)
    for r, begin, until in sorted(waits, key=lambda w: w[1] - w[2]):  # the longest waits first
        mbs, room, space = [], until - begin, 0
        for j in list(one):
            if not one or room < t_in[one[-1]]:
                break
            new = not mbs or load[j] > space
            if t_in[j] + (m if new else 0.0) <= room:
                if new:
                    mbs.append([])
                    space, room = footprint.cap, room - m
                mbs[-1].append(j)
                space, room = space - load[j], room - t_in[j]
                one.remove(j)
        if mbs:
            entries.append((begin, (r,), mbs))
    tails: dict[int, list] = {}
    for j in one:  # the rest longest first to the rank that ends first
        r = int(np.argmin(free))
        tail = tails.setdefault(r, [float(free[r]), [], 0])
        if not tail[1] or load[j] > tail[2]:
            tail[1].append([])
            tail[2] = footprint.cap
            free[r] += m
        tail[1][-1].append(j)
        tail[2] -= load[j]
        free[r] += t_in[j]
    entries += [(begin, (r,), mbs) for r, (begin, mbs, _) in tails.items()]
    return float(free.max()), entries


# ---------------------------------------------------------------- planning
def run(args: argparse.Namespace, console: Console) -> list[dict]:
    """One record per (variant, workload, batch): both bounds, dhp's, the witness's and each planner's step."""
    base = CostConfig.load(VARIANT_BASE)
    cases = [(v, w, n) for v in CASES for w in args.workloads for n in args.ranks]
    records = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(cases) * args.batches)
        for variant, workload, ranks in cases:
            model = build_cost_model(base.with_overrides(**VARIANTS[variant], world_size=ranks))
            source = (LengthSource(name=workload, distribution=LONG_WORKLOADS[workload]) if workload in LONG_WORKLOADS
                      else LengthSource.from_args(dist=workload))
            capacity = model.domain.capacity
            batches = [source.draw(global_batch=args.global_batch, seed=args.seed, index=k, capacity=capacity)
                       for k in range(args.batches)]
            context = PlannerContext(dataset_max_tokens=dataset_max_tokens(source, batches, capacity))
            for k, batch in enumerate(batches):
                best = best_lower_bound(model, batch.samples)
                record = {"variant": variant, "workload": workload, "ranks": ranks, "batch": k, "best_lb_s": best,
                          "new_lb_s": max(best, forced_width_lower_bound(model, batch.samples)),
                          "witness_s": simulate(witness_plan(batch, model, tries=args.tries, seed=k), model).step_time_s}
                for name in args.planners:
                    try:
                        plan = run_planner(build_planner(name, context), batch, model,
                                           family=planning_family(name, model, args))
                        record[name] = plan.predicted_step_time_s
                    except PlannerUnsupported:
                        record[name] = None
                records.append(record)
                progress.advance(task)
    return records


# ---------------------------------------------------------------- the verdict
def split_gap(dhp: float, witness: float, best: float, new: float) -> dict[str, float]:
    """dhp's gap over the best bound, split: what the new bound proves of it the bound's, what the witness
    proves the planner's, and what is left open (all as fractions of the best bound)."""
    reached = min(dhp, witness)
    return {"gap": dhp / best - 1.0, "bound": new / best - 1.0, "planner": (dhp - reached) / best,
            "open": max(0.0, reached - new) / best}


def verdict(split: dict[str, float]) -> str:
    """Which is loose: "tight" (gap under `TIGHT`), else the larger proven part, "open" where neither
    accounts for half of the gap."""
    if split["gap"] < TIGHT:
        return "tight"
    part = max(("planner", "bound"), key=lambda k: split[k])
    return part if split[part] >= split["gap"] / 2 else "open"


def rows(records: list[dict], planners: list[str]) -> list[dict]:
    """Per (variant, workload, ranks): dhp over each bound (mean, max), the witness over the new bound (mean),
    each peer over the new bound (mean, max), the mean split of the gap and its verdict."""
    out = []
    for case in dict.fromkeys((r["variant"], r["workload"], r["ranks"]) for r in records):
        variant, workload, ranks = case
        mine = [r for r in records if (r["variant"], r["workload"], r["ranks"]) == case and r["dhp"] is not None]
        if not mine:
            continue
        best = np.array([r["dhp"] / r["best_lb_s"] for r in mine])
        new = np.array([r["dhp"] / r["new_lb_s"] for r in mine])
        splits = [split_gap(r["dhp"], r["witness_s"], r["best_lb_s"], r["new_lb_s"]) for r in mine]
        split = {k: float(np.mean([s[k] for s in splits])) for k in splits[0]}
        peers = {p: [r[p] / r["new_lb_s"] for r in mine if r.get(p) is not None] for p in planners if p != "dhp"}
        behind = max(r["dhp"] / min([r["witness_s"], *(r[p] for p in planners if p != "dhp" and r.get(p) is not None)])
                     for r in mine)
        out.append({"variant": variant, "workload": workload, "ranks": ranks, "batches": len(mine),
                    "dhp/best peer max": behind,
                    "dhp/best": (float(best.mean()), float(best.max())), "dhp/new": (float(new.mean()), float(new.max())),
                    "witness/new": float(np.mean([r["witness_s"] / r["new_lb_s"] for r in mine])),
                    "peers": {p: float(np.mean(v)) if v else None for p, v in peers.items()},
                    "split": split, "verdict": verdict(split)})
    return out


def summary(table_rows: list[dict]) -> list[str]:
    """Per variant: dhp over the best provable bound on average over the shipped workloads against the
    target, and how the gap is settled."""
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in table_rows):
        shipped = [r for r in table_rows if r["variant"] == variant and r["workload"] in WORKLOADS]
        if shipped:
            mean = float(np.mean([r["dhp/new"][0] for r in shipped]))
            met = "within" if mean <= TARGET else "not within"
            lines.append(f"{variant}: dhp / best provable bound {mean:.3f} on average over the shipped workloads "
                         f"({met} {TARGET - 1:.0%} of it)")
        long = [r for r in table_rows if r["variant"] == variant and r["workload"] in LONG_WORKLOADS]
        if long:
            mean = float(np.mean([r["dhp/best"][0] for r in long]))
            behind = max(r["dhp/best peer max"] for r in long)
            lines.append(f"{variant}: dhp / best bound {mean:.3f} on average over the long-context rows "
                         f"({'within' if mean <= LONG_TARGET else 'not within'} {LONG_TARGET - 1:.0%}); on its worst "
                         f"batch {behind:.3f} x the best of the witness and the peers")
    raised = max((r["split"]["bound"] for r in table_rows), default=0.0)
    planner = max((r["split"]["planner"] for r in table_rows), default=0.0)
    how = (f"(a) the new bound raises the best one by up to {raised:.1%}" if raised >= planner else
           f"(b) the bound is not shown loose (the new bound raises it by {raised:.2%} at most); the planner is: "
           f"a list schedule beats dhp by up to {planner:.1%} of the bound")
    return lines + [f"settled as {how}"]


def print_report(table_rows: list[dict], planners: list[str], console: Console) -> None:
    """The table and the summary lines."""
    peers = [p for p in planners if p != "dhp"]
    table = Table(title="dhp's step against the best bound, the new bound and a witness plan")
    cols = ["variant", "workload", "ranks", "batches", "dhp/best LB mean (max)", "dhp/new LB mean (max)",
            "witness/new LB", *(f"{p}/new LB" for p in peers), "dhp/best other max", "gap: bound / planner / open",
            "verdict"]
    for col in cols:
        table.add_column(col, justify="right")
    for r in table_rows:
        s = r["split"]
        table.add_row(r["variant"], r["workload"], str(r["ranks"]), str(r["batches"]),
                      "{:.3f} ({:.3f})".format(*r["dhp/best"]), "{:.3f} ({:.3f})".format(*r["dhp/new"]),
                      f"{r['witness/new']:.3f}", *("n/a" if r["peers"][p] is None else f"{r['peers'][p]:.3f}" for p in peers),
                      f"{r['dhp/best peer max']:.3f}",
                      f"{s['bound']:.1%} / {s['planner']:.1%} / {s['open']:.1%}", r["verdict"])
    console.print(table)
    for line in summary(table_rows):
        console.print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=3, help="batches per workload and variant (default 3)")
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tries", type=int, default=200, help="list schedules the witness tries per batch (default 200)")
    parser.add_argument("--workloads", default=",".join([*WORKLOADS, LONG_CONTEXT.name]),
                        help=f"plan_quality's workloads and {', '.join(LONG_WORKLOADS)} (default: the shipped ones "
                             f"and {LONG_CONTEXT.name})")
    parser.add_argument("--ranks", default="64", help="domain sizes, comma-separated (default 64)")
    parser.add_argument("--planners", default="dhp", help="dhp and any peers to score against the same bounds")
    parser.add_argument("--comm", default="mixed", help=argparse.SUPPRESS)  # planning_family reads it
    parser.add_argument("--json", metavar="FILE", help="write every record and the table rows as JSON")
    args = parser.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.ranks = [int(n) for n in args.ranks.split(",") if n]
    args.planners = list(dict.fromkeys(["dhp", *(p for p in args.planners.split(",") if p)]))
    unknown = [p for p in args.planners if p not in PLANNERS]
    if unknown:
        parser.error(f"unknown planner {unknown[0]!r}; choose from {', '.join(PLANNERS)}")
    console = Console(width=170)
    records = run(args, console)
    table_rows = rows(records, args.planners)
    print_report(table_rows, args.planners, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records, "rows": table_rows}, f, indent=1)


if __name__ == "__main__":
    main()
