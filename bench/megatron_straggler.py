"""Megatron-LM's pretrain_gpt.py (patched) on 4 gloo ranks with one rank slowed: the closed loop against
speed-blind dhp and upstream, side by side.

Three runs of the same job on mock data (documents as sequences, 512-token rows, 32 per step): upstream
(no --dhp), --dhp with the closed loop (the default) and --dhp with --no-dhp-adaptive; both --dhp runs slow
global rank 1 by `--factor` (--dhp-slow-rank) and price plans with the CPU-profiled preset
(--dhp-cost tiny-gpt-cpu: at M = 512 a row fits one rank, so plans may give rank 1 fewer rows). Prints each
run's median "elapsed time per iteration" after `--warmup` iterations, the ratios, the largest relative
difference of a logged loss from upstream's (6 digits are logged), and the slow ranks of the last plan line.
Upstream runs at full speed: its step shows what the slowed rank costs.

    megatron-dhp apply-patches --megatron-lm mlm      # a Megatron-LM core_v0.16.1 checkout (docs/megatron-lm.md)
    python bench/megatron_straggler.py --megatron-lm mlm [--iters 30] [--factor 2.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatron_dhp.launch.ranks import free_port
from megatron_dhp.testing.megatron_recipe import tiny_gpt_flags

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask"]
DHP = ["--dhp", "--dhp-max-tokens-per-rank", "512", "--dhp-cost", "tiny-gpt-cpu", "--dhp-log-plans",
       "--no-create-attention-mask-in-dataloader"]


def run(tree: Path, iters: int, flags: list[str]) -> dict:
    """One training run: per-iteration milliseconds, losses and the last plan line's slow ranks."""
    recipe = tiny_gpt_flags(seq_length=512, global_batch=32, iters=iters, eval_interval=100_000)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
               str(REPO / "scripts" / "megatron_lm_cpu.py"), *recipe, *DOCUMENTS, *flags]
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    log = out.stdout + out.stderr
    if out.returncode:
        raise SystemExit(f"error: pretrain_gpt.py failed ({' '.join(flags)}):\n{log[-3000:]}")
    slow = re.findall(r"closed loop: slow ([^|]*)\|", log)
    return {"ms": [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)],
            "losses": [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", log)],
            "slow_ranks_last": slow[-1].strip() if slow else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM checkout with the patch applied")
    parser.add_argument("--iters", type=int, default=30, help="training iterations per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out of the medians (default 5)")
    parser.add_argument("--factor", type=float, default=2.0, help="slowdown of global rank 1 (default 2.0)")
    parser.add_argument("--json", metavar="FILE", help="also write every run's numbers as JSON")
    args = parser.parse_args()
    script = args.megatron_lm / "pretrain_gpt.py"
    if not script.is_file() or "megatron_dhp" not in script.read_text():
        raise SystemExit(f"error: {script} is not a patched pretrain_gpt.py; run megatron-dhp apply-patches "
                         f"--megatron-lm {args.megatron_lm} first")

    console = Console()
    slowed = [*DHP, "--dhp-slow-rank", f"1:{args.factor:g}"]
    runs = {}
    for name, flags in (("upstream", []), ("adaptive", slowed), ("blind", [*slowed, "--no-dhp-adaptive"])):
        console.print(f"[bold]{name}[/]: {args.iters} iterations on 4 gloo ranks ...")
        runs[name] = run(args.megatron_lm, args.iters, flags)
    median = {name: statistics.median(r["ms"][args.warmup:]) for name, r in runs.items()}
    upstream = runs["upstream"]["losses"]
    differ = {name: max((abs(a - b) / abs(b) for a, b in zip(r["losses"], upstream)), default=float("nan"))
              if len(r["losses"]) == len(upstream) else float("inf") for name, r in runs.items() if name != "upstream"}

    table = Table(title=f"pretrain_gpt.py, 4 gloo ranks, 32 x 512 tokens per step; --dhp runs with rank 1 slowed "
                        f"{args.factor:g}x; medians of iterations {args.warmup + 1}-{args.iters}")
    for col in ("run", "median ms / iteration", "blind / run", "max rel. loss diff to upstream", "last plan line's slow ranks"):
        table.add_column(col, justify="right")
    for name, r in runs.items():
        table.add_row(name, f"{median[name]:.1f}", f"{median['blind'] / median[name]:.2f}x",
                      "-" if name == "upstream" else f"{differ[name]:.1e}", r["slow_ranks_last"] or "-")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "median_ms": median, "max_rel_loss_diff": differ,
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
