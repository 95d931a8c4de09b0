"""dhp against the static layout a user would tune: the best (TP, CP) of the same GPUs, not CP at TP 1.

For each workload of `bench/plan_quality.py` on GPT-7B over 64 GPUs (gpt7b-64 with its tensor-parallel terms:
32 heads, 8 x 4096 x 2 x 32 bytes of TP collectives per token, `--tp-efficiency` per doubling), the same
batches under: `static` at TP 1 (the smallest CP that holds the longest sample: the README's old baseline),
`static-best` (every power-of-two TP in the node and CP from that minimum up, packed as `static`, the fastest
on these batches: `solver.static_best.tune_static`), dhp at TP 1, and dhp at its best TP. Prints mean
simulated step times and the two ratios: static at TP 1 over dhp at TP 1, and static-best over dhp-best.

    python bench/tp_baseline.py [--batches 4] [--tp-efficiency 0.9] [--workloads wlbllm,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from rich.console import Console
from rich.progress import track
from rich.table import Table

from megatron_dhp.cost import CostConfig
from megatron_dhp.solver.static_best import tune_dhp, tune_static
from megatron_dhp.workload import LengthSource

GPT7B_TP = {"attention_heads": 32, "tp_comm_bytes_per_token": 8 * 4096 * 2 * 32}
"""GPT-7B's heads and its sequence-parallel all-gathers and reduce-scatters per token (bf16, 32 layers of 4096)."""


def compare(base: CostConfig, workload: str, batches: int) -> dict:
    """The four layouts' mean steps on `batches` batches of 512 samples of `workload`."""
    source = LengthSource.from_args(dist=workload)
    drawn = [source.draw(global_batch=512, seed=0, index=k, capacity=base.world_size * base.max_tokens_per_rank)
             for k in range(batches)]
    static, dhp = tune_static(base, drawn), tune_dhp(base, drawn)
    fixed = min((s for s in static if s.tp == 1), key=lambda s: s.cp)  # the smallest CP at TP 1
    dhp1 = next(d for d in dhp if d.tp == 1)
    return {"workload": workload, "static_tp1": fixed.__dict__, "static_best": static[0].__dict__,
            "dhp_tp1": dhp1.__dict__, "dhp_best": dhp[0].__dict__,
            "old_ratio": fixed.step_s / dhp1.step_s, "tuned_ratio": static[0].step_s / dhp[0].step_s}


def main() -> None:
    from plan_quality import WORKLOADS  # bench/ is the script's own directory

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=4, help="batches of 512 samples per workload (default 4)")
    parser.add_argument("--tp-efficiency", type=float, default=0.9,
                        help="share of the ideal speed-up each TP doubling keeps (default 0.9; 1: ideal)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: plan_quality's)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    base = replace(CostConfig.load("gpt7b-64"), tp_efficiency=args.tp_efficiency, **GPT7B_TP)
    rows = [compare(base, w, args.batches) for w in track(args.workloads.split(","), description="tuning")]
    table = Table(title=f"GPT-7B on 64 GPUs, {args.batches} x 512 samples, TP efficiency {args.tp_efficiency} per doubling")
    for column in ("workload", "static TP 1 (CP)", "static-best (TP, CP)", "dhp TP 1", "dhp best (TP)",
                   "static TP 1 / dhp TP 1", "static-best / dhp best"):
        table.add_column(column)
    for r in rows:
        s1, sb, d1, db = r["static_tp1"], r["static_best"], r["dhp_tp1"], r["dhp_best"]
        table.add_row(r["workload"], f"{s1['step_s']:.2f} s (CP {s1['cp']})", f"{sb['step_s']:.2f} s (TP {sb['tp']}, CP {sb['cp']})",
                      f"{d1['step_s']:.2f} s", f"{db['step_s']:.2f} s (TP {db['tp']})", f"{r['old_ratio']:.2f}x",
                      f"{r['tuned_ratio']:.2f}x")
    Console(width=160).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
