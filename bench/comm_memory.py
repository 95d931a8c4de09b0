"""What one NCCL communicator costs in GPU memory, created three ways, measured on this machine's GPUs.

For each (ranks, way) the bench starts that many local NCCL ranks (they share the GPUs round robin; NCCL
may refuse two ranks on one GPU, which the report then says), creates K groups of all of them, runs one
all-reduce on each (NCCL connects lazily, on first use) and reads the device's used memory before and after
(`torch.cuda.mem_get_info`, which sees NCCL's own allocations outside torch's caching allocator). Ways:

- `new`: `dist.new_group` on a default group without a bound device: a communicator initialised from scratch.
- `split`: the default group bound to its device (`init_process_group(device_id=...)`), so `new_group` splits
  the parent (`ncclCommSplit`) and reuses its bootstrap.
- `split-share`: `split` with `NCCL_COMM_SPLIT_SHARE_RESOURCES=1`: the children share the parent's buffers.

The per-group figure is (used after - used before) / K / ranks per GPU. It feeds the comm policy's
`communicator_mb` default (docs/configuration.md). Without CUDA it prints that nothing ran and exits 3.

    python bench/comm_memory.py [--groups 8] [--ranks 1,2] [--out comm_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

WAYS = ("new", "split", "split-share")
MIB = 2**20
TIMEOUT_S = 120
"""Wall-clock limit of one (ranks, way) run; NCCL set-up that hangs becomes a recorded failure."""


def _worker(rank: int, world: int, way: str, groups: int, port: int, out: str) -> None:
    """One rank: the default group, K groups of every rank, one all-reduce each; rank 0 writes the numbers."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    bound = {"device_id": device} if way != "new" else {}
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60), **bound)
    x = torch.ones(1024, device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier()
    free_before, total = torch.cuda.mem_get_info(device)
    made = [dist.new_group(list(range(world))) for _ in range(groups)]
    for group in made:
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    dist.barrier()
    free_after, _ = torch.cuda.mem_get_info(device)
    if rank == 0:
        Path(out).write_text(json.dumps({"used_before_mib": (total - free_before) / MIB,
                                         "used_after_mib": (total - free_after) / MIB}))
    dist.destroy_process_group()


def measure(world: int, way: str, groups: int) -> dict:
    """One (ranks, way) in a child process with a deadline: the per-group MiB, or why it failed."""
    out = Path(f"/tmp/comm_memory_{os.getpid()}_{world}_{way}.json")
    out.unlink(missing_ok=True)
    env = {**os.environ, "NCCL_COMM_SPLIT_SHARE_RESOURCES": "1" if way == "split-share" else "0"}
    cmd = [sys.executable, __file__, "--child", str(world), way, str(groups), str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ranks": world, "way": way, "error": f"no result within {TIMEOUT_S} s"}
    if proc.returncode != 0 or not out.exists():
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        return {"ranks": world, "way": way, "error": " | ".join(lines[-3:])[-600:]}
    got = json.loads(out.read_text())
    per_gpu = -(-world // torch.cuda.device_count())
    delta = got["used_after_mib"] - got["used_before_mib"]
    return {"ranks": world, "way": way, "groups": groups, **got, "mib_per_group_per_rank": delta / groups / per_gpu}


def _child(world: int, way: str, groups: int, out: str) -> None:
    """Spawn the ranks of one measurement (separate from the parent so a hang or crash is contained)."""
    import torch.multiprocessing as mp

    from megatron_dhp.launch.ranks import free_port

    mp.spawn(_worker, args=(world, way, groups, free_port(), out), nprocs=world, join=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8, help="groups created per run (default 8)")
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    parser.add_argument("--out", default="comm_memory.json", help="report path (default comm_memory.json)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        world, way, groups, out = args.child
        _child(int(world), way, int(groups), out)
        return 0
    console = Console()
    if not torch.cuda.is_available():
        console.print("no CUDA device: nothing measured")
        return 3
    rows = [measure(int(n), way, args.groups) for n in args.ranks.split(",") for way in WAYS]
    table = Table(title=f"NCCL communicator memory on {torch.cuda.get_device_name()} ({args.groups} groups)")
    for col in ("ranks", "way", "MiB per group per rank", "note"):
        table.add_column(col)
    for r in rows:
        mib = f"{r['mib_per_group_per_rank']:.1f}" if "mib_per_group_per_rank" in r else "-"
        table.add_row(str(r["ranks"]), r["way"], mib, r.get("error", ""))
    console.print(table)
    report = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if any("mib_per_group_per_rank" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
