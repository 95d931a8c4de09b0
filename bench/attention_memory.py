"""Peak memory and CPU time of the context-parallel attention variants on one long sample, by group size.

For each group size d (d gloo ranks on this machine) and tokens per rank t, one sample of d * t tokens is
zigzag-sharded over the group and each variant runs one forward and backward. Peak bytes: the most bytes
the CPU allocator held during that step, its q/k/v included (torch profiler memory events), the largest
over the ranks. Time: the slowest rank's wall time of the step, the best of --repeats. Ring should stay flat in
d where allgather grows with the group's tokens.

    python bench/attention_memory.py [--tokens 2048] [--sizes 1,2,3,4] [--heads 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from megatron_dhp.launch.ranks import launch

VARIANTS = ("allgather", "ring", "ulysses")
HEAD_DIM = 32


def step(comm: str, tokens: int, heads: int) -> None:
    """One forward and backward of `comm` on this rank's shard of one sample of `tokens` per rank."""
    from megatron_dhp.runtime.attention.context import CPContext
    from megatron_dhp.runtime.attention.core_attention import VARIANTS as FUNCTIONS
    from megatron_dhp.runtime.layout import MicrobatchLayout

    layout = MicrobatchLayout((0,), (tokens * dist.get_world_size(),), dist.get_world_size(), dist.get_rank())
    q, k, v = (torch.randn(tokens, heads, HEAD_DIM, requires_grad=True) for _ in range(3))
    out = FUNCTIONS[comm](q, k, v, CPContext(layout, dist.group.WORLD, comm, "sdpa"), HEAD_DIM**-0.5)
    out.sum().backward()


def peak_bytes(fn) -> int:
    """Most bytes live on the CPU allocator during `fn()`, counted from its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def rank_worker(tokens_list: list[int], heads: int, repeats: int, variants: list[str]) -> list[dict]:
    """On every rank: peak bytes and best time per (tokens per rank, variant)."""
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rows = []
    for tokens in tokens_list:
        for comm in variants:
            step(comm, tokens, heads)  # warm-up
            peak = peak_bytes(lambda: step(comm, tokens, heads))  # noqa: B023 - called at once
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                step(comm, tokens, heads)
                times.append(time.perf_counter() - start)
            rows.append({"tokens_per_rank": tokens, "comm": comm, "peak_bytes": peak, "seconds": min(times)})
    dist.destroy_process_group()
    return rows


def measure(tokens: list[int], sizes: list[int], heads: int, repeats: int, variants: list[str]) -> list[dict]:
    """One row per (tokens per rank, group size, variant): the worst rank's peak bytes and time."""
    rows = []
    for size in sizes:
        per_rank = launch(rank_worker, size, tokens, heads, repeats, variants, timeout_s=900)
        for cells in zip(*per_rank):
            rows.append({**cells[0], "group_size": size, "peak_bytes": max(c["peak_bytes"] for c in cells),
                         "seconds": max(c["seconds"] for c in cells)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048", help="tokens per rank, comma-separated (default 2048)")
    parser.add_argument("--sizes", default="1,2,3,4", help="group sizes, comma-separated (default 1,2,3,4)")
    parser.add_argument("--heads", type=int, default=4, help=f"attention heads of {HEAD_DIM} dims (default 4)")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per cell, the best counts (default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    tokens, sizes = [int(x) for x in args.tokens.split(",")], [int(x) for x in args.sizes.split(",")]
    rows = measure(tokens, sizes, args.heads, args.repeats, list(VARIANTS))
    cell = {(r["tokens_per_rank"], r["group_size"], r["comm"]): r for r in rows}

    console = Console()
    memory = Table(title=f"peak bytes per rank, one forward + backward ({args.heads} heads x {HEAD_DIM}, fp32, CPU)")
    for name in ("tokens/rank", "group", "allgather MB", "ring MB", "ulysses MB", "allgather / ring"):
        memory.add_column(name, justify="right")
    speed = Table(title="CPU seconds per forward + backward (slowest rank)")
    for name in ("tokens/rank", "group", "allgather s", "ring s", "ulysses s", "ring / allgather"):
        speed.add_column(name, justify="right")
    for t in tokens:
        for d in sizes:
            mb = {c: cell[t, d, c]["peak_bytes"] / 2**20 for c in VARIANTS}
            s = {c: cell[t, d, c]["seconds"] for c in VARIANTS}
            memory.add_row(str(t), str(d), *(f"{mb[c]:.1f}" for c in VARIANTS), f"{mb['allgather'] / mb['ring']:.2f}")
            speed.add_row(str(t), str(d), *(f"{s[c]:.2f}" for c in VARIANTS), f"{s['ring'] / s['allgather']:.2f}")
    console.print(memory)
    console.print(speed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
