"""Real CPU training with a slow rank: the closed loop (adaptive dhp) against speed-blind dhp, side by side;
or (`--pair shards`) uneven shards against even ones, both with the loop on.

Two ways to slow one rank, each run twice on the same batches and weights (`--pair loop`: `dhp.adaptive` on,
then off; `--pair shards`: the cost model's `uneven_shards` on, then off, so a group holding the slow rank gives
it a share of each sample in proportion to its speed, then an equal one):

* injection: `dhp.slow_ranks` holds every slot of rank 1 `--factor` times as long (`closed_loop.injection`);
* contention: each rank pinned to its own core (`train.pin_cores`) and a busy process pinned to rank 1's
  core, so the OS shares that core between them, as a noisy neighbour shares a GPU.

Both runs start from a cost model `--wrong` times too fast (the preset's coefficients divided), so the loop
must also find the machine's time scale. Prints per case: median step time of each run and their ratio,
the median of per-step ratios, both also over the steps after `--warmup` (the loop's steady state), the
largest relative loss difference between the runs, the slow rank and speed the loop settled on, and the
share of steps after `--warmup` whose predicted forward+backward time is within 10 % of the measured one
(adaptive run), with the same share for the first steps and the share that the one correction factor best
in hindsight would reach (the noise floor of this machine).

    python bench/straggler_train.py [--steps 30] [--factor 2.0] [--wrong 3.0] [--cases injection,contention]
                                    [--pair loop|shards] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatron_dhp.cost import CostConfig
from megatron_dhp.training.config import TrainConfig
from megatron_dhp.training.train import TrainResult, train

SLOW_RANK = 1


def burn(core: int, stop_at: float) -> None:
    """A busy loop pinned to `core` until `stop_at` (the competing process of the contention case)."""
    os.sched_setaffinity(0, {core})
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) % 2**31


PAIRS = {"loop": ("adaptive", "blind"), "shards": ("uneven", "even")}
"""The two runs each `--pair` compares: the first is the one whose speed-up over the second is measured."""


def run_pair(config: TrainConfig, pair: str, costs: dict[str, Path]) -> dict[str, TrainResult]:
    """The same job twice: the closed loop on and off, or uneven shards on and off (`costs`: each run's cost
    model)."""
    first, second = PAIRS[pair]
    if pair == "loop":
        return {mode: train(config.with_overrides(dhp={"adaptive": mode == first}), show=False) for mode in (first, second)}
    return {mode: train(config.with_overrides(dhp={"cost": str(costs[mode])}), show=False) for mode in (first, second)}


def within(result: TrainResult, steps: slice, tolerance: float = 0.10) -> float:
    """Share of the steps whose predicted forward+backward time is within `tolerance` of the measured."""
    records = result.records[steps]
    return sum(abs(r.predicted_s / r.measured_s - 1) <= tolerance for r in records) / max(1, len(records))


def best_constant(result: TrainResult, steps: slice, tolerance: float = 0.10) -> float:
    """The share `within` reaches if every prediction is scaled by the one factor best in hindsight: what the
    step-to-step noise leaves to any predictor that knows the machine's level exactly."""
    ratios = [r.measured_s / r.predicted_s for r in result.records[steps]]
    factors = [q * (1 + e) for q in ratios for e in (-tolerance, tolerance)]  # the best one ends a band
    return max((sum(abs(k / q - 1) <= tolerance + 1e-12 for q in ratios) / len(ratios) for k in factors), default=0.0)


def summarise(case: str, runs: dict[str, TrainResult], warmup: int) -> dict:
    """The case's numbers: step times and ratios, loss agreement, the loop's estimate, prediction accuracy (the
    first run's)."""
    fast, slow = runs.values()
    paired = statistics.median(b.wall_s / a.wall_s for a, b in zip(fast.records, slow.records))
    settled = [(a.wall_s, b.wall_s) for a, b in zip(fast.records[warmup:], slow.records[warmup:])]
    loss_diff = max(abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(fast.records, slow.records))
    return {
        "case": case,
        "first_median_s": fast.median_step_s,
        "second_median_s": slow.median_step_s,
        "speedup": slow.median_step_s / fast.median_step_s,
        "paired_speedup": paired,
        # after the loop's warm-up (the steps prediction accuracy counts): the adaptive run's steady state
        "speedup_after_warmup": statistics.median(b for _, b in settled) / statistics.median(a for a, _ in settled),
        "paired_after_warmup": statistics.median(b / a for a, b in settled),
        "max_rel_loss_diff": loss_diff,
        "slow_ranks_last": fast.records[-1].slow_ranks,
        "within_10pct_after_warmup": within(fast, slice(warmup, None)),
        "within_10pct_first_steps": within(fast, slice(0, warmup)),
        "within_10pct_best_constant": best_constant(fast, slice(warmup, None)),
        "within_10pct_second": within(slow, slice(warmup, None)),
        **{mode: [r.__dict__ for r in result.records] for mode, result in runs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo_cpu", help="train config (default demo_cpu)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--factor", type=float, default=2.0, help="injected slowdown of rank 1 (default 2.0)")
    parser.add_argument("--wrong", type=float, default=3.0,
                        help="start from the config's cost model this many times too fast (default 3.0; 1: as is)")
    parser.add_argument("--warmup", type=int, default=8, help="steps before prediction accuracy counts (default 8)")
    parser.add_argument("--cases", default="injection,contention", help="injection, contention or both")
    parser.add_argument("--pair", choices=list(PAIRS), default="loop",
                        help="loop: the closed loop on against off (default); shards: uneven shards against even "
                             "ones, the loop on in both")
    parser.add_argument("--json", metavar="FILE", help="also write every record as JSON")
    args = parser.parse_args()

    base = TrainConfig.load(args.config).with_overrides(train={"steps": args.steps, "nproc": 2, "pin_cores": True},
                                                        data={"global_batch": args.global_batch})
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        wrong = CostConfig.load(base.dhp.cost).scaled(1.0 / args.wrong)
        costs = {mode: Path(tmp) / f"{mode}_cost.yaml" for mode in PAIRS["shards"]}
        for mode, path in costs.items():
            replace(wrong, uneven_shards=mode == "uneven").save(path)
        base = base.with_overrides(dhp={"cost": str(costs["uneven"]), "planner": "dhp"})
        first, second = PAIRS[args.pair]
        for case in args.cases.split(","):
            console.print(f"[bold]{case}[/]: {first}, then {second}, {args.steps} steps each ...")
            if case == "injection":
                runs = run_pair(base.with_overrides(dhp={"slow_ranks": (f"{SLOW_RANK}:{args.factor}",)}), args.pair, costs)
            elif case == "contention":
                cores = sorted(os.sched_getaffinity(0))
                if len(cores) < 2:
                    raise SystemExit("contention needs two cores (one per rank)")
                stop_at = time.time() + 3600
                competitor = multiprocessing.get_context("spawn").Process(target=burn, args=(cores[SLOW_RANK], stop_at))
                competitor.start()
                try:
                    runs = run_pair(base, args.pair, costs)
                finally:
                    competitor.terminate()
                    competitor.join()
            else:
                raise SystemExit(f"unknown case {case!r}; use injection or contention")
            rows.append(summarise(case, runs, args.warmup))

    table = Table(title=f"2 gloo ranks, {args.steps} steps of {args.global_batch} samples; cost model "
                        f"{args.wrong:g}x too fast at the start; rank {SLOW_RANK} slowed")
    for col in ("case", f"{first} step", f"{second} step", "speed-up", "per-step median",
                f"speed-up (steps {args.warmup + 1}+)", f"per-step median (steps {args.warmup + 1}+)", "max loss diff",
                "loop's slow ranks", f"pred within 10% (steps {args.warmup + 1}+)", f"(steps 1-{args.warmup})",
                "best constant factor", f"{second} pred within 10%"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["case"], f"{r['first_median_s']:.3f}s", f"{r['second_median_s']:.3f}s", f"{r['speedup']:.2f}x",
                      f"{r['paired_speedup']:.2f}x", f"{r['speedup_after_warmup']:.2f}x", f"{r['paired_after_warmup']:.2f}x",
                      f"{r['max_rel_loss_diff']:.1e}", r["slow_ranks_last"] or "none",
                      f"{100 * r['within_10pct_after_warmup']:.0f}%", f"{100 * r['within_10pct_first_steps']:.0f}%",
                      f"{100 * r['within_10pct_best_constant']:.0f}%", f"{100 * r['within_10pct_second']:.0f}%")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cases": rows}, f, indent=1, default=str)
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
