"""Looking at a job's processes from outside (Linux /proc): the launcher tells a stopped rank from one that
waits, and the fault tests and `bench/faults.py` find a launcher's ranks, signal them, and check that none is
left."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def children(pid: int, marker: str = "spawn_main") -> list[int]:
    """The child processes of `pid` whose command line holds `marker`, in start order (a launcher's ranks:
    "spawn_main" for spawned ones, "megatron_dhp" under torchrun; its resource tracker is not one)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return sorted(c for c in found if marker in Path(f"/proc/{c}/cmdline").read_text(errors="replace"))


def state(pid: int) -> str | None:
    """The process's state letter in /proc (R, S, T stopped, Z zombie, ...); None where it is gone or there is
    no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    return state(pid) not in (None, "Z")


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `condition` every 50 ms until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
