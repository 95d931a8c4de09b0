"""Start N local ranks the way torchrun would, run one function on each, collect what each returns.

Used by `megatron-dhp selftest` (when not already under torchrun) and by the multi-process tests. Each
rank gets the torchrun environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, OMP_NUM_THREADS) so the same function
also runs unchanged under a real `torchrun`. A wall-clock deadline terminates every rank, so a hang
becomes an error instead of a stuck job.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


class LaunchError(RuntimeError):
    """A rank raised, died or ran past the deadline; the message carries its traceback or exit code."""


def free_port() -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 600.0, env: dict[str, str] | None = None
) -> list[Any]:
    """Run `fn(*args)` on `nproc` spawned ranks; returns their results in rank order.

    `fn` must be importable by name (a module-level function) and return something picklable. `env` adds
    variables to the environment the ranks start with.
    """
    ctx = mp.get_context("spawn")
    results: queue.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, nproc, port, results, args)) for rank in range(nproc)]
    # A spawned rank imports numpy (and with it OpenBLAS, which sizes its thread pool once, at import) while
    # unpickling `fn`, before `_entry` runs; so the thread count must be in the environment it starts with.
    # Idle OpenBLAS threads spin, and on a machine with a core per rank they would take the other ranks' cores.
    start_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    saved = {k: os.environ.get(k) for k in start_env}
    os.environ.update(start_env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + timeout_s
    done: dict[int, Any] = {}
    try:
        while len(done) < nproc:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if dead:
                    raise LaunchError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result") from None
                if time.monotonic() > deadline:
                    raise LaunchError(f"ranks {sorted(set(range(nproc)) - set(done))} ran past {timeout_s:.0f} s") from None
                continue
            if not ok:
                raise LaunchError(f"rank {rank} raised:\n{value}")
            done[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(done) == nproc else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [done[r] for r in range(nproc)]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, results: mp.Queue, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    # Like torchrun: one intra-op thread per rank unless the user chose otherwise. N ranks with a thread per
    # core each oversubscribe the machine, and spinning OpenMP workers then slow small ops 100-fold.
    import torch

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - report anything, the parent decides
        results.put((rank, False, traceback.format_exc()))
