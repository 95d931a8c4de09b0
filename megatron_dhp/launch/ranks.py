"""Start N local ranks the way torchrun would, run one function on each, collect what each returns.

Used by `megatron-dhp selftest` (when not already under torchrun) and by the multi-process tests. Each
rank gets the torchrun environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, OMP_NUM_THREADS) so the same function
also runs unchanged under a real `torchrun`. A wall-clock deadline terminates every rank, so a hang
becomes an error instead of a stuck job.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from megatron_dhp.errors import DhpError
from megatron_dhp.launch.parent import state, wait_until


class LaunchError(RuntimeError):
    """A rank raised, died or ran past the deadline; the message carries its traceback or exit code."""


class LaunchStopped(LaunchError):
    """This process was told to stop (SIGTERM or SIGHUP, forwarded to the ranks) and the ranks ended without a
    result: the signal reached them during start-up, before they could stop at a step boundary."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def free_port() -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one (a container's or taskset's
    share), else every core of the machine."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


OVERSUBSCRIPTION = 2
"""How many ranks per usable core `check_oversubscription` lets through without being asked (tests run 4 ranks
on 2 cores; beyond 2 a rank waits for a core longer than it computes)."""


def check_oversubscription(nproc: int, *, oversubscribe: bool, timeout: str = "train.timeout_s") -> None:
    """A `DhpError` before `nproc` local ranks are spawned on more than `OVERSUBSCRIPTION` x the usable cores,
    unless the user said `oversubscribe`; `timeout` names the setting whose collectives such ranks may reach."""
    cores = usable_cores()
    most = OVERSUBSCRIPTION * cores
    if nproc > most and not oversubscribe:
        raise DhpError(f"--nproc {nproc} spawns {nproc} ranks on {cores} core{'s' * (cores > 1)}: ranks time-slice, "
                       f"step times say nothing and collectives may reach {timeout}; pass --nproc {most} or less, "
                       "or --oversubscribe")


def _start_env(env: dict[str, str] | None) -> dict[str, str]:
    """What a rank's interpreter starts with beyond this process's environment: `env`, and one OpenMP thread
    unless the user chose otherwise. A rank imports numpy (and with it OpenBLAS, which sizes its thread pool
    once, at import) before it runs anything of ours; idle OpenBLAS threads spin, and on a machine with a core
    per rank they would take the other ranks' cores."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}


@contextlib.contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """This process's environment with `extra` set while the block runs (a process started inside inherits it),
    as it was afterwards."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def launch(
    fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 600.0, env: dict[str, str] | None = None
) -> list[Any]:
    """Run `fn(*args)` on `nproc` spawned ranks; returns their results in rank order.

    `fn` must be importable by name (a module-level function) and return something picklable. `env` adds
    variables to the environment the ranks start with.
    """
    served = _fork_server is not None
    ctx = mp.get_context("forkserver" if served else "spawn")
    results: queue.Queue = ctx.Queue()
    port = free_port()
    # `fn` and `args` travel as bytes that a rank unpickles only after it watches its parent: unpickling
    # imports torch and megatron-core (seconds), and a launcher killed meanwhile would leave orphans.
    payload = pickle.dumps((fn, args))
    start_env = _start_env(env)
    # A forked rank starts from the fork server's environment and streams, not this process's: it is given them.
    given = ({**os.environ, **start_env}, _Stream(1), _Stream(2)) if served else None
    procs = [ctx.Process(target=_entry, args=(given, os.getpid(), rank, nproc, port, results, payload))
             for rank in range(nproc)]
    with _environment(start_env):
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout_s
    done: dict[int, Any] = {}
    failed: dict[int, str] = {}  # rank -> its traceback
    stop = _Forwarder(procs)
    settle = math.inf  # once a rank failed or died: the others get SETTLE_S to fail or die too
    try:
        try:
            with stop:
                while len(done) < nproc and time.monotonic() < settle:
                    try:
                        rank, ok, value = results.get(timeout=0.2)
                    except queue.Empty:
                        if any(p.exitcode not in (None, 0) for r, p in enumerate(procs) if r not in done):
                            settle = min(settle, time.monotonic() + SETTLE_S)
                        if time.monotonic() > min(deadline, stop.deadline):
                            late = sorted(set(range(nproc)) - set(done))
                            raise LaunchError(f"stopped by {stop.name}: ranks {late} did not finish their step within "
                                              f"{STOP_GRACE_S:.0f} s" if stop.received else
                                              f"ranks {late} ran past {timeout_s:.0f} s") from None
                        continue
                    if ok:
                        done[rank] = value
                    else:
                        failed[rank] = value
                        settle = min(settle, time.monotonic() + SETTLE_S)
        except KeyboardInterrupt:
            _wind_down(procs)
            raise
        if len(done) < nproc and stop.received:
            raise LaunchStopped(f"stopped by {stop.name} before a step boundary (the ranks were starting): nothing "
                                "saved", stop.received)
        if len(done) < nproc:
            raise LaunchError(_fault(procs, done, failed))
    finally:
        for p in procs:
            p.join(timeout=5 if len(done) == nproc else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [done[r] for r in range(nproc)]


STOP_GRACE_S = 60.0
"""After SIGTERM or SIGHUP, how long the ranks may take to finish their step (and save) before they are
killed (a scheduler kills on its own after its grace: Slurm's KillWait is 30 s by default)."""
SETTLE_S = 2.0
"""After one rank fails, how long the others get to fail or exit, so the report names the rank that caused
it (a killed rank's peers fail in its collective within a moment) rather than the first to speak."""


def _wind_down(procs: list) -> None:
    """After Ctrl-C (SIGINT: KeyboardInterrupt here): the ranks, which a terminal interrupts too, get `SETTLE_S`
    to end on their own, so that rank 0 releases what it holds (the save folder's lock); a rank still running
    then (this process alone was interrupted) is sent SIGINT and gets `SETTLE_S` more before it is killed."""
    def ended() -> bool:
        return not any(p.is_alive() for p in procs)

    if not wait_until(ended, SETTLE_S):
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        wait_until(ended, SETTLE_S)


class _Forwarder:
    """While the ranks run: SIGTERM or SIGHUP to this process goes on to every rank (which stop at their
    next step boundary) and shortens the wait to `STOP_GRACE_S`; a second one stops waiting at once."""

    def __init__(self, procs: list) -> None:
        self.procs = procs
        self.received = 0
        self.deadline = math.inf
        self._saved: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name

    def __enter__(self) -> _Forwarder:
        if threading.current_thread() is threading.main_thread():  # handlers belong to the main thread
            self._saved = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _forward(self, signum: int, frame: object) -> None:
        if self.received:
            raise LaunchError(f"stopped by {self.name} and {signal.Signals(signum).name}: ranks killed without a checkpoint")
        self.received = signum
        self.deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signum)


def _fault(procs: list, done: dict[int, Any], failed: dict[int, str]) -> str:
    """Which rank brought the job down: one killed by a signal, or stopped, or that exited without a result,
    before one that raised; the others' errors as one line each (theirs follow from it)."""
    lines = {r: _last_line(tb) for r, tb in failed.items()}
    culprits = []
    for r, p in enumerate(procs):
        if r in done or r in failed:
            continue
        if p.exitcode is not None and p.exitcode < 0:
            culprits.append(f"rank {r} was killed by {signal.Signals(-p.exitcode).name}")
        elif p.exitcode not in (None, 0):
            culprits.append(f"rank {r} exited with code {p.exitcode} without a result")
        elif state(p.pid) in ("T", "t"):
            culprits.append(f"rank {r} stopped responding (its process is stopped: SIGSTOP or SIGTSTP)")
        elif lines and all("timed out" in line.lower() for line in lines.values()):
            culprits.append(f"rank {r} stopped responding (its peers timed out waiting for it)")
    if not culprits:  # a rank raised on its own: its traceback is the news
        first = min(failed)
        others = "".join(f"\n(rank {r}: {line})" for r, line in sorted(lines.items()) if r != first)
        return f"rank {first} raised:\n{failed[first]}{others}"
    return "; ".join(culprits) + "".join(f"\n(rank {r} then failed: {line})" for r, line in sorted(lines.items()))


def _last_line(text: str) -> str:
    """A traceback's last non-empty line: the exception."""
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), text)


WATCH_S = 0.5
"""How often a rank looks whether the process that started it is still there."""


def exit_with_parent(parent: int | None = None) -> None:
    """Exit this process (status 1) as soon as its parent (`parent`, default the current one) is gone: a
    launcher killed with SIGKILL runs no handler, and its ranks would train on as orphans (a daemon thread
    polls the parent). A `parent` that is already gone ends the process at once."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)  # nobody reads this rank's result any more, and its peers exit alike

    threading.Thread(target=watch, name="dhp-parent-watch", daemon=True).start()


_fork_server: tuple[str, ...] | None = None
"""The modules the fork server imported, once `start_ranks_from_fork_server` was called; None: ranks spawn."""


def start_ranks_from_fork_server(modules: Sequence[str], env: dict[str, str] | None = None) -> None:
    """From now on, fork every launch's ranks from one server process that imported `modules` once, instead of
    spawning interpreters that import torch and megatron-core anew (seconds per rank per launch): for a process
    that launches many small jobs, the test suite. Each rank still gets this process's environment, stdout
    and stderr at its launch; what an interpreter reads only at start-up (PYTHONWARNINGS) is the server's,
    which starts with `env` added (and one OpenMP thread, as a launch's ranks do)."""
    global _fork_server
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(list(modules))
    with _environment(_start_env(env)):
        forkserver.ensure_running()
    _fork_server = tuple(modules)


class _Stream:
    """One of the launcher's standard streams (fd 1 or 2), given to a rank forked by the fork server (which
    holds the streams of whoever started it): the rank's output goes where a spawned rank's would."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _attach, (self.fd, mp.reduction.DupFd(self.fd))


def _attach(target: int, dup: Any) -> int:
    fd = dup.detach()
    os.dup2(fd, target)
    os.close(fd)
    return target


def _entry(given: tuple | None, launcher: int, rank: int, world: int, port: int, results: mp.Queue,
           payload: bytes) -> None:
    exit_with_parent(None if given else launcher)  # a forked rank's parent is the fork server, which ends with us
    if given:
        os.environ.clear()
        os.environ.update(given[0])
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    # Like torchrun: one intra-op thread per rank unless the user chose otherwise. N ranks with a thread per
    # core each oversubscribe the machine, and spinning OpenMP workers then slow small ops 100-fold.
    import torch

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    try:
        fn, args = pickle.loads(payload)
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - report anything, the parent decides
        results.put((rank, False, traceback.format_exc()))
    finally:  # the one tear-down of every launched function's process groups
        with contextlib.suppress(Exception):
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
