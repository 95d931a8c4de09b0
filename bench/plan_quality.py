"""Plan quality: every planner on the same batches, under the reference cost model, side by side.

Workloads: the WLB-LLM lengths and four synthetic distributions (`megatron-dhp dists` documents them):
lognormal-pareto (long tail), bimodal, giant (one sample at 90% of N x M) and multimodal (images and video,
so the encoder terms matter). Domains: N = 64 and N = 48 (not a power of two), 8 ranks per node, GPT-7B
coefficients (configs/gpt7b-64.yaml, gpt7b-48.yaml). Global batch 512, 10 batches each. A domain is any cost
preset: `--domains mixtral-8x7b-64` gives the MoE rows (Mixtral-8x7B, EP 8; text-only, so a multimodal
sample's image tokens go through it as text).

Prints per workload and domain: mean step time, step / lower bound (mean and max), solver ms (p50, p95),
and dhp's speed-up over every other planner; then dhp's targets, each with the measured value. dhp
plans as under the training default `comm: mixed`, with any group (`--comm allgather`: its group family).
A planner whose source cannot plan a batch (e.g. megatron-hcp on N = 48) is reported as n/a there.

    python bench/plan_quality.py [--batches 10] [--time-limit 10] [--json out.json] [--plot out.png]
    python bench/plan_quality.py --pp 4 --planners dhp,static,megatron-hcp,fcp-ref   # 1F1B over 4 stages
    python bench/plan_quality.py --planners dhp,static,megatron-hcp,fcp-ref --domains mixtral-8x7b-64   # MoE
    python bench/plan_quality.py --from-json fast.json flexsp.json   # tables and targets of stored runs
    python bench/plan_quality.py --variants --planners dhp,static,megatron-hcp,fcp-ref --batches 3 [--any-groups]
    python bench/plan_quality.py --comm allgather ...   # dhp held to its group family, as under comm allgather

`--from-json` joins the records of earlier `--json` runs (e.g. the fast planners on 10 batches and
flexsp-milp, minutes per batch, on the first few of the same batches) and prints them as one run.

`--variants` runs the planners on the workloads under variants of the gpt7b-64 cost model instead (see
`VARIANTS`) and prices each plan against the best lower bound (`cost.bound.best_lower_bound`).

`--multimodal` runs the planners on the multimodal workload with the encoder priced under each encoder
placement (`--placements`, default split,replicate,global,auto; `cost.encoder`), every plan against the best
lower bound of its placement (auto: the least over the placements), and prints per placement dhp's step / best
LB (mean, max) and dhp / each peer (mean, max) against their targets (<= 1.03 x best LB on average, never
more than 0.5 % behind a peer). The best bound (`best_lower_bound`: the larger of the reference bound and the
coupled one, at P = 1) is another quantity than a plan's `lower_bound_s`, the bound of the main table, of
`Plan.summary` (the Megatron plan line) and of `--variants`' "ref LB" column:

    python bench/plan_quality.py --multimodal --planners dhp,megatron-hcp,fcp-ref --domains gpt7b-64 --batches 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from tuning import tune_dhp  # bench/tuning.py (this folder is the script's sys.path[0])

from megatron_dhp.cli.common import dataset_max_tokens
from megatron_dhp.cost import CostConfig, build_cost_model
from megatron_dhp.cost.bound import best_lower_bound
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.comm import STEP_COMMS
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.solver import (
    PLANNERS,
    PlannerContext,
    PlannerUnsupported,
    build_planner,
    planner_comm_policy,
    run_planner,
)
from megatron_dhp.solver.static_best import tune_static
from megatron_dhp.workload import LengthSource

WORKLOADS = ("wlbllm", "lognormal-pareto", "bimodal", "giant", "multimodal")
DOMAINS = ("gpt7b-64", "gpt7b-48")
PEERS = ("megatron-hcp", "fcp-ref", "flexsp-milp")
GPT7B_TP = {"attention_heads": 32, "tp_comm_bytes_per_token": 8 * 4096 * 2 * 32}
"""GPT-7B's heads and its sequence-parallel all-gathers and reduce-scatters per token (bf16, 32 layers of 4096):
the tensor-parallel terms `--tuned` prices the presets' TP layouts with."""
TUNED = ("static-best", "dhp-best-tp")



def batches_and_planners(model, workload: str, args: argparse.Namespace) -> tuple[list, list]:
    """The workload's batches for this domain and every requested planner, built for them, with the family it
    plans on under `--comm` (`CommPolicy.planning_family`), as training plans."""
    source = LengthSource.from_args(dist=workload)
    capacity = model.domain.capacity
    batches = [source.draw(global_batch=args.global_batch, seed=args.seed, index=k, capacity=capacity)
               for k in range(args.batches)]
    context = PlannerContext(dataset_max_tokens=dataset_max_tokens(source, batches, capacity),
                             time_limit_s=args.time_limit)
    return batches, [(build_planner(name, context), planning_family(name, model, args)) for name in args.planners]


def planning_family(name: str, model, args: argparse.Namespace):
    """The family planner `name` keeps to under `--comm` on the model's domain (None: any group)."""
    d = model.domain
    return planner_comm_policy(name, args.comm, world_size=d.world_size, gpus_per_node=d.gpus_per_node).planning_family


def run(args: argparse.Namespace, console: Console) -> list[dict]:
    """Plan every batch with every planner; one record per (domain, workload, batch, planner)."""
    records = []
    cases = [(d, w) for d in args.domains for w in args.workloads]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(cases) * args.batches * len(args.planners))
        for domain, workload in cases:
            model = build_cost_model(CostConfig.load(domain))
            batches, planners = batches_and_planners(model, workload, args)
            if args.tuned:
                records += tuned_records(domain, workload, batches, args)
            for k, batch in enumerate(batches):
                for planner, family in planners:
                    record = {"domain": domain, "workload": workload, "batch": k, "planner": planner.name}
                    try:
                        plan = run_planner(planner, batch, model, family=family, pipeline_stages=args.pp)
                        record.update(step_s=plan.predicted_step_time_s, lb_s=plan.lower_bound_s,
                                      ratio=plan.predicted_step_time_s / plan.lower_bound_s,
                                      solve_ms=plan.solve_time_ms, summary=plan.summary())
                    except PlannerUnsupported as e:
                        record.update(step_s=None, unsupported=str(e))
                    records.append(record)
                    progress.advance(task)
            if args.json:  # a long run (flexsp-milp) keeps what it has measured if it is stopped
                save_json(args.json, records, [])
    return records


def tuned_records(domain: str, workload: str, batches: list, args: argparse.Namespace) -> list[dict]:
    """`static-best` (the (TP, CP) a user tunes once on these batches) and dhp at its best TP, a record per
    batch each, TP priced with GPT-7B's terms at `--tp-efficiency` (`solver.static_best`, `tuning.tune_dhp`)."""
    base = dataclasses.replace(CostConfig.load(domain), tp_efficiency=args.tp_efficiency, **GPT7B_TP)
    best = {"static-best": tune_static(base, batches)[0], "dhp-best-tp": tune_dhp(base, batches)[0]}
    return [{"domain": domain, "workload": workload, "batch": k, "planner": name, "step_s": layout.steps[k],
             "layout": f"TP {layout.tp}" + (f" CP {layout.cp}" if layout.cp else "")}
            for name, layout in best.items() for k in range(len(batches))]


def save_json(path: str, records: list[dict], results: list[tuple[str, str, bool]]) -> None:
    """Every record and the targets, for `--from-json`."""
    with open(path, "w") as f:
        json.dump({"records": records, "targets": [dict(target=w, measured=v, met=bool(m)) for w, v, m in results]}, f, indent=1)


def load_records(paths: list[str]) -> list[dict]:
    """The records of several `--json` runs, one per (domain, workload, batch, planner); a planner that two
    runs both hold must agree (dhp is deterministic, so its step times must match exactly)."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        try:
            with open(path) as f:
                records = json.load(f)["records"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"error: {path} is not a plan_quality --json file ({e}); rerun with --json {path}") from None
        for r in records:
            key = (r["domain"], r["workload"], r["batch"], r["planner"])
            if r["planner"] == "dhp" and key in merged and merged[key]["step_s"] != r["step_s"]:
                raise SystemExit(f"error: dhp planned {key[:3]} differently in {path}; were the runs made with different seeds?")
            merged.setdefault(key, r)
    return list(merged.values())


def print_tables(records: list[dict], args: argparse.Namespace, console: Console) -> None:
    """One table per (domain, workload)."""
    by_case = defaultdict(list)
    for r in records:
        by_case[(r["domain"], r["workload"])].append(r)
    for (domain, workload), rows in by_case.items():
        batches = len({r["batch"] for r in rows})
        pp = f", PP {args.pp}" if getattr(args, "pp", 1) > 1 else ""
        table = Table(title=f"{workload} on {domain}: {batches} batches of {args.global_batch}{pp}")
        for col in ("planner", "step s", "step/LB mean", "step/LB max", "solve ms p50", "solve ms p95", "dhp speed-up", "n/a"):
            table.add_column(col, justify="right")
        dhp = {r["batch"]: r["step_s"] for r in rows if r["planner"] == "dhp"}
        for name in args.planners:
            mine = [r for r in rows if r["planner"] == name and r["step_s"] is not None]
            na = sum(1 for r in rows if r["planner"] == name and r["step_s"] is None)
            if not mine:
                if na:
                    table.add_row(name, *["n/a"] * 6, str(na))
                continue
            ratio = np.array([r["ratio"] for r in mine])
            solve = np.array([r["solve_ms"] for r in mine])
            speedup = np.mean([r["step_s"] / dhp[r["batch"]] for r in mine]) if dhp else float("nan")
            table.add_row(name, f"{np.mean([r['step_s'] for r in mine]):.3f}", f"{ratio.mean():.4f}", f"{ratio.max():.4f}",
                          f"{np.percentile(solve, 50):.1f}", f"{np.percentile(solve, 95):.1f}", f"{speedup:.3f}x", str(na))
        console.print(table)


def planned(records: list[dict]) -> dict[tuple, dict]:
    """The records of planned batches by (domain, workload, batch, planner); unsupported ones left out."""
    return {(r["domain"], r["workload"], r["batch"], r["planner"]): r for r in records if r.get("step_s") is not None}


def markdown_line(cells: list[str]) -> str:
    """One line of a markdown table."""
    return "| " + " | ".join(cells) + " |"


def markdown_table(cols: list[str], rows: list[list[str]]) -> str:
    """A markdown table: its header, its rule and one line per row (as many cells as `cols`)."""
    return "\n".join([markdown_line(cols), "|" + "---|" * len(cols), *map(markdown_line, rows)])


def markdown_summary(records: list[dict], planners: list[str]) -> str:
    """The README table: per (workload, domain), dhp's mean step / LB and its mean speed-up over each peer
    (over the batches that peer planned; n/a where it planned none); no peer columns when dhp ran alone."""
    step = planned(records)
    peers = [p for p in planners if p != "dhp"]
    rows = []
    for domain, workload in dict.fromkeys((r["domain"], r["workload"]) for r in records):
        dhp = {k[2]: v for k, v in step.items() if k[:2] == (domain, workload) and k[3] == "dhp"}
        cells = []
        for p in peers:
            ratios = [step[(domain, workload, b, p)]["step_s"] / d["step_s"] for b, d in dhp.items()
                      if (domain, workload, b, p) in step]
            cells.append(f"{np.mean(ratios):.3f}x ({len(ratios)})" if ratios else "n/a")
        tuned = {name: {k[2]: v for k, v in step.items() if k[:2] == (domain, workload) and k[3] == name} for name in TUNED}
        if all(tuned.values()):  # --tuned: dhp at its best TP against the static (TP, CP) a user would tune
            layout = next(iter(tuned["static-best"].values()))["layout"]
            ratios = [tuned["static-best"][b]["step_s"] / d["step_s"] for b, d in tuned["dhp-best-tp"].items()]
            cells.append(f"{np.mean(ratios):.3f}x ({layout})")
        n = CostConfig.load(domain).world_size
        mean = np.mean([v["ratio"] for v in dhp.values()])
        rows.append([workload, str(n), f"{mean:.4f}", *cells])
    tuned_col = ["dhp best TP vs static-best (TP, CP)"] if any(r["planner"] in TUNED for r in records) else []
    return markdown_table(["workload", "N", "dhp step / LB", *(f"dhp vs {p}" for p in peers), *tuned_col], rows)


def targets(records: list[dict]) -> list[tuple[str, str, bool]]:
    """dhp's plan-quality targets: (what, measured, met)."""
    step = planned(records)
    keys = sorted({k[:3] for k in step})
    dhp = [step[k + ("dhp",)] for k in keys if k + ("dhp",) in step]
    out = []
    ratios = np.array([r["ratio"] for r in dhp])
    out.append(("dhp step / LB, mean over all batches (<= 1.03)", f"{ratios.mean():.4f}", ratios.mean() <= 1.03))
    out.append(("dhp step / LB, worst batch (<= 1.08)", f"{ratios.max():.4f}", ratios.max() <= 1.08))
    worst = max(((step[k + ("dhp",)]["step_s"] / step[k + (p,)]["step_s"], p)
                 for k in keys for p in PEERS + ("static",) if k + (p,) in step and k + ("dhp",) in step), default=None)
    if worst is not None:  # dhp ran beside a peer
        out.append(("dhp / peer step, worst batch (<= 1.005)", f"{worst[0]:.4f} (vs {worst[1]})", worst[0] <= 1.005))
    hard, compared = [], 0
    for k in keys:
        peers = [step[k + (p,)] for p in PEERS if k + (p,) in step]
        if peers and k + ("dhp",) in step:
            compared += 1
            best = min(peers, key=lambda r: r["step_s"])
            if best["ratio"] > 1.05:
                hard.append(best["step_s"] / step[k + ("dhp",)]["step_s"])
    if hard:
        out.append((f"best peer / dhp where best peer > 1.05 LB, mean over {len(hard)} batches (>= 1.05)",
                    f"{np.mean(hard):.4f}", np.mean(hard) >= 1.05))
    elif compared:  # a peer planned beside dhp, and none was above 1.05 LB
        out.append(("best peer / dhp where best peer > 1.05 LB (>= 1.05)", "no such batch", True))
    static = [step[k + ("static",)]["step_s"] / step[k + ("dhp",)]["step_s"] for k in keys
              if k + ("static",) in step and k + ("dhp",) in step]
    if static:
        out.append(("static / dhp step, mean (>= 1.5)", f"{np.mean(static):.3f}", np.mean(static) >= 1.5))
    at_64 = {d for d in {r["domain"] for r in dhp} if CostConfig.load(d).world_size == 64}
    solve = np.array([r["solve_ms"] for r in dhp if r["domain"] in at_64])
    if solve.size:
        out.append(("dhp solve ms p50 at (512, 64) (<= 10)", f"{np.percentile(solve, 50):.1f}", np.percentile(solve, 50) <= 10))
    return out


def plot(records: list[dict], args: argparse.Namespace, path: str) -> None:
    """Grouped bars: mean step / LB per planner for every (domain, workload)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cases = [(d, w) for d in args.domains for w in args.workloads]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(args.planners)
    for j, name in enumerate(args.planners):
        means = []
        for d, w in cases:
            vals = [r["ratio"] for r in records if (r["domain"], r["workload"], r["planner"]) == (d, w, name) and r.get("step_s")]
            means.append(np.mean(vals) if vals else np.nan)
        ax.bar(np.arange(len(cases)) + j * width, means, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, [f"{w}\n{d}" for d, w in cases], fontsize=7)
    ax.set_ylabel("mean step / lower bound")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yticks([1, 1.1, 1.25, 1.5, 2, 3, 4])
    ax.legend(fontsize=8, ncol=len(args.planners), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------- --variants: beyond the reference model
VARIANT_BASE = "gpt7b-64"
VARIANTS: dict[str, dict[str, object]] = {
    "reference": {},
    "no overlap": {"overlap_comm": False},
    "4 per node": {"gpus_per_node": 4},
    "72 per node": {"gpus_per_node": 72},
    "M 4096": {"max_tokens_per_rank": 4096},
    "M 32768": {"max_tokens_per_rank": 32768},
    "N 40": {"world_size": 40},
    "N 256": {"world_size": 256},
    "N 1024": {"world_size": 1024},
    "inter 5 GB/s": {"inter_node_bytes_per_s": 5.0e9},
    "m 0.2 s": {"microbatch_overhead_s": 0.2},
}
"""Cost-model variants of `VARIANT_BASE`: the fields each one overrides."""
ANY_GROUPS = "dhp-any"
"""dhp with any groups (no family), planned with `--any-groups`: dhp / dhp-any is the family's cost."""


def run_variants(args: argparse.Namespace, console: Console) -> list[dict]:
    """Plan every batch with every planner under every variant; one record per (variant, workload, batch,
    planner), each with the reference bound and the best bound of its batch."""
    records = []
    base = CostConfig.load(VARIANT_BASE)
    cases = [(v, w) for v in VARIANTS for w in args.workloads]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning variants", total=len(cases) * args.batches * (len(args.planners) + args.any_groups))
        for variant, workload in cases:
            model = build_cost_model(base.with_overrides(**VARIANTS[variant]))
            batches, planners = batches_and_planners(model, workload, args)
            if args.any_groups:  # the family's cost: dhp / dhp-any
                planners.append((dataclasses.replace(build_planner("dhp"), name=ANY_GROUPS), None))
            for k, batch in enumerate(batches):
                best_s = best_lower_bound(model, batch.samples)
                for planner, family in planners:
                    record = {"variant": variant, "workload": workload, "batch": k, "planner": planner.name, "best_lb_s": best_s}
                    try:
                        plan = run_planner(planner, batch, model, family=family)
                        record.update(step_s=plan.predicted_step_time_s, lb_s=plan.lower_bound_s, solve_ms=plan.solve_time_ms)
                    except PlannerUnsupported as e:
                        record.update(step_s=None, unsupported=str(e))
                    records.append(record)
                    progress.advance(task)
    return records


def variant_rows(records: list[dict], planners: list[str]) -> list[dict]:
    """Per variant: each planner's step / best bound (mean, max), dhp's step / reference bound (mean), and
    dhp / peer step (mean, worst) over the batches both planned."""
    rows = []
    for variant in dict.fromkeys(r["variant"] for r in records):
        mine = [r for r in records if r["variant"] == variant and r["step_s"] is not None]
        step = {(r["workload"], r["batch"], r["planner"]): r for r in mine}
        dhp = {k[:2]: r for k, r in step.items() if k[2] == "dhp"}
        row: dict = {"variant": variant, "batches": len(dhp)}
        for p in planners:
            ratios = [r["step_s"] / r["best_lb_s"] for k, r in step.items() if k[2] == p]
            row[p] = (float(np.mean(ratios)), float(np.max(ratios))) if ratios else None
        row["dhp/LB"] = float(np.mean([r["step_s"] / r["lb_s"] for r in dhp.values()])) if dhp else float("nan")
        for p in planners:
            if p != "dhp":
                vs = [d["step_s"] / step[k + (p,)]["step_s"] for k, d in dhp.items() if k + (p,) in step]
                row[f"vs {p}"] = (float(np.mean(vs)), float(np.max(vs))) if vs else None
        rows.append(row)
    return rows


def print_variants(records: list[dict], args: argparse.Namespace, console: Console) -> None:
    """The variant table, and its markdown form with `--markdown`."""
    planners = [*args.planners, *([ANY_GROUPS] if args.any_groups else [])]
    rows = variant_rows(records, planners)
    peers = [p for p in planners if p != "dhp"]
    cols = ["variant", *(f"{p} step/best LB mean (max)" for p in args.planners), "dhp step/ref LB mean",
            *(f"dhp / {p} mean (max)" for p in peers)]

    def cells(row: dict) -> list[str]:
        pair = [f"{row[p][0]:.3f} ({row[p][1]:.3f})" if row[p] else "n/a" for p in args.planners]
        vs = [f"{row[f'vs {p}'][0]:.3f} ({row[f'vs {p}'][1]:.3f})" if row[f"vs {p}"] else "n/a" for p in peers]
        return [row["variant"], *pair, f"{row['dhp/LB']:.3f}", *vs]

    table = Table(title=f"variants of {VARIANT_BASE}: {len(args.workloads)} workloads x {args.batches} batches of {args.global_batch}")
    for col in cols:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*cells(row))
    console.print(table)
    if args.markdown:
        print(markdown_table(cols, [cells(row) for row in rows]))


MM_A2A_BYTES_PER_TOKEN = 4096 * 2 * 2
"""`global`'s embedding all-to-all for GPT-7B: hidden 4096, bf16, forward and backward."""


def run_placements(args: argparse.Namespace, console: Console) -> list[dict]:
    """The multimodal workload under every encoder placement; one record per (domain, placement, batch,
    planner), each with the best bound of the placement the plan was priced with."""
    records = []
    cases = [(d, p) for d in args.domains for p in args.placements]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning placements", total=len(cases) * args.batches * len(args.planners))
        for domain, placement in cases:
            config = CostConfig.load(domain).with_overrides(enc_a2a_bytes_per_token=MM_A2A_BYTES_PER_TOKEN,
                                                            enc_memory_per_token=args.enc_memory)
            model = build_cost_model(config.with_overrides(encoder_placement=placement))
            batches, planners = batches_and_planners(model, "multimodal", args)
            for k, batch in enumerate(batches):
                n = model.domain.world_size
                bounds = {p: best_lower_bound(model.with_placement(p), batch.samples) for p in CONCRETE_PLACEMENTS
                          if model.with_placement(p).footprint(batch.samples).min_degree().max() <= n}
                for planner, family in planners:
                    record = {"domain": domain, "placement": placement, "batch": k, "planner": planner.name}
                    try:
                        plan = run_planner(planner, batch, model, family=family)
                    except (PlannerUnsupported, DhpError) as e:  # DhpError: the placement cannot hold the images
                        record.update(step_s=None, unsupported=str(e))
                    else:
                        lb = min(bounds.values()) if placement == "auto" else bounds[plan.encoder_placement]
                        record.update(step_s=plan.predicted_step_time_s, best_lb_s=lb, solve_ms=plan.solve_time_ms,
                                      chosen=plan.encoder_placement)
                    records.append(record)
                    progress.advance(task)
    return records


def print_placements(records: list[dict], args: argparse.Namespace, console: Console) -> None:
    """Per (domain, placement): dhp's step / best LB (not the plan's own bound) and dhp / each peer, with their
    targets."""
    peers = [p for p in args.planners if p != "dhp"]
    cols = ["domain", "placement", "dhp step/best LB mean (max)", *(f"{p} step/best LB mean" for p in peers),
            *(f"dhp / {p} mean (max)" for p in peers), "auto chose (dhp)", "targets met"]
    table = Table(title=f"multimodal, encoder placements: {args.batches} batches of {args.global_batch}")
    for col in cols:
        table.add_column(col, justify="right")
    lines = []
    for domain, placement in dict.fromkeys((r["domain"], r["placement"]) for r in records):
        done = {(r["batch"], r["planner"]): r for r in records
                if (r["domain"], r["placement"]) == (domain, placement) and r["step_s"] is not None}
        dhp = {b: r for (b, p), r in done.items() if p == "dhp"}
        ratio = np.array([r["step_s"] / r["best_lb_s"] for r in dhp.values()])
        cells = [domain, placement, f"{ratio.mean():.4f} ({ratio.max():.4f})" if len(ratio) else "n/a"]
        worst_vs = 0.0
        for p in peers:
            mine = [r["step_s"] / r["best_lb_s"] for (b, q), r in done.items() if q == p]
            cells.append(f"{np.mean(mine):.4f}" if mine else "n/a")
        for p in peers:
            vs = [d["step_s"] / done[(b, p)]["step_s"] for b, d in dhp.items() if (b, p) in done]
            worst_vs = max([worst_vs, *vs])
            cells.append(f"{np.mean(vs):.4f} ({np.max(vs):.4f})" if vs else "n/a")
        chose = ", ".join(f"{k} {v}" for k, v in sorted(
            {c: sum(1 for r in dhp.values() if r["chosen"] == c) for c in {r["chosen"] for r in dhp.values()}}.items()))
        met = len(ratio) and ratio.mean() <= 1.03 and worst_vs <= 1.005
        held = any(r["planner"] == "dhp" and "encoder activations" in r.get("unsupported", "") for r in records
                   if (r["domain"], r["placement"]) == (domain, placement))
        cells += [chose if placement == "auto" else "", "yes" if met else "memory" if held and not len(ratio) else "no"]
        table.add_row(*cells)
        lines.append(cells)
    console.print(table)
    if args.markdown:
        print(markdown_table(cols, lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=10.0, help="flexsp-milp HiGHS time limit, seconds")
    parser.add_argument("--planners", default=",".join(["dhp", "static", *PEERS]))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--domains", default=",".join(DOMAINS))
    parser.add_argument("--pp", type=int, default=1, metavar="P",
                        help="pipeline stages: plan (dhp) and price (every planner) as 1F1B slots")
    parser.add_argument("--json", metavar="FILE", help="write every record and the targets as JSON")
    parser.add_argument("--plot", metavar="PNG", help="bar chart of mean step / LB")
    parser.add_argument("--markdown", action="store_true", help="also print the README summary table")
    parser.add_argument("--from-json", nargs="+", metavar="FILE", help="report the records of earlier --json runs instead of planning")
    parser.add_argument("--variants", action="store_true", help=f"plan under the cost-model variants of {VARIANT_BASE} (VARIANTS)")
    parser.add_argument("--multimodal", action="store_true",
                        help="plan the multimodal workload under each encoder placement (--placements)")
    parser.add_argument("--placements", default="split,replicate,global,auto",
                        help="encoder placements for --multimodal (default split,replicate,global,auto)")
    parser.add_argument("--enc-memory", type=float, default=0.0, metavar="W",
                        help="--multimodal: encoder activations per encoder token, in LLM tokens (cost key "
                             "enc_memory_per_token; 0, the reference, counts LLM tokens only; 0.19: a 300M ViT on GPT-7B)")
    parser.add_argument("--comm", choices=tuple(STEP_COMMS), default="mixed",
                        help="the training comm dhp plans for: under mixed (the default) and p2p any group costs no "
                             "communicator, so dhp plans with any group; under allgather, ring, ulysses with its family")
    parser.add_argument("--tuned", action="store_true",
                        help="also tune static's (TP, CP) and dhp's TP on each workload's batches (TP priced with "
                             "GPT-7B's terms) and report dhp best TP against static-best")
    parser.add_argument("--tp-efficiency", type=float, default=0.9,
                        help="--tuned: share of the ideal speed-up each TP doubling keeps (default 0.9; 1: ideal)")
    parser.add_argument("--any-groups", action="store_true",
                        help=f"with --variants, also plan dhp with any groups as {ANY_GROUPS} (the group family's cost)")
    args = parser.parse_args()
    for key in ("planners", "workloads", "domains", "placements"):
        setattr(args, key, [x for x in getattr(args, key).split(",") if x])
    unknown = [p for p in args.planners if p not in PLANNERS]
    if unknown:
        parser.error(f"unknown planner {unknown[0]!r}; choose from {', '.join(PLANNERS)}")

    console = Console(width=150)
    special = (run_placements, print_placements) if args.multimodal else \
        (run_variants, print_variants) if args.variants else None
    if special is not None:  # the multimodal placements or the cost-model variants instead of the main table
        plan_all, report = special
        records = plan_all(args, console)
        report(records, args, console)
        if args.json:
            save_json(args.json, records, [])
        return
    if args.from_json:
        records = load_records(args.from_json)
        present = {r["planner"] for r in records}
        args.planners = [p for p in PLANNERS if p in present]
        args.domains = list(dict.fromkeys(r["domain"] for r in records))
        args.workloads = list(dict.fromkeys(r["workload"] for r in records))
    else:
        records = run(args, console)
    print_tables(records, args, console)
    table = Table(title="targets for dhp")
    for col in ("target", "measured", "met"):
        table.add_column(col)
    results = targets(records) if "dhp" in args.planners else []
    for what, value, met in results:
        table.add_row(what, value, "[green]yes" if met else "[red]no")
    console.print(table)
    if args.markdown:
        print(markdown_summary(records, args.planners))
    if args.json:
        save_json(args.json, records, results)
    if args.plot:
        plot(records, args, args.plot)
        console.print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
