"""Fault injection for tests and benchmarks (`DhpConfig.slow_ranks`), kept out of the production timer: a
wrapper around the closed loop's `SlotClock` that a job puts on only when it injects (`timer_for_job`).

A slowed rank holds each slot `slowdown` times as long, waiting after the slot's own work, as a throttled GPU
would; the results do not change. Every rank of such a job (`hold`) then waits at the end of each multi-rank
slot for the group's last member, as a throttled GPU holds its group inside the collectives (without it the
others would leave during the wait): a token passes around the group's ring size - 1 times. Both happen inside
the clock's slot, so the clock measures them as it would a throttled GPU. On a GPU a slowed rank synchronises
each slot to measure its own work: tests and benchmarks only.

Under pipeline parallelism megatron-core's 1F1B runs the slots untimed, so an injected slowdown would slow nothing
and the loop would learn nothing from it: `check_injection` refuses it, for every entry point (the trainer's
config and `JobSpec`, `selftest`; Megatron-LM's refusals table says it with `INJECTION_UNDER_PP`). A rank the job
does not have would be slowed by nobody: `check_injected_ranks` refuses it where the world size is known.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_dhp.closed_loop.slot_clock import SlotClock
from megatron_dhp.cost.speeds import parse_slowdowns
from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention.comm import PeerRing, start_shift
from megatron_dhp.runtime.slot_timer import UNTIMED_UNDER_PP, SlotTimer

INJECTION_UNDER_PP = f"{UNTIMED_UNDER_PP}, so an injected slowdown would slow nothing"
"""Why `slow_ranks` is refused with pipeline_stages > 1 (the middle of every such refusal)."""


def check_injection(slow_ranks: Sequence[str], pipeline_stages: int, *, given: str = "slow_ranks",
                    stages: str = "pipeline_stages") -> None:
    """A one-line `DhpError` when `slow_ranks` (the `RANK:FACTOR` items) would be injected under pipeline
    parallelism; `given` and `stages` name the two settings as the entry point's user sets them."""
    if slow_ranks and pipeline_stages > 1:
        raise DhpError(f"{given} {' '.join(slow_ranks)} with {stages} {pipeline_stages}: {INJECTION_UNDER_PP}; drop "
                       f"{given}, or inject with {stages} 1")


def check_injected_ranks(slow_ranks: Sequence[str], world_size: int, *, given: str = "--slow-rank") -> None:
    """A one-line `DhpError` when `slow_ranks` (the `RANK:FACTOR` items) name a rank outside a job of
    `world_size` ranks, which nothing would slow; entry points ask once the world size is known, before a step."""
    for item in slow_ranks:
        (rank,) = parse_slowdowns([item])
        if rank >= world_size:
            raise DhpError(f"{given} {item} names rank {rank}, but the job has {world_size} ranks (0 to "
                           f"{world_size - 1}); slow one of those")


class InjectedSlowdown:
    """A `SlotClock` whose slots this rank holds `slowdown` times as long, and (`hold`) whose multi-rank slots
    end only when the group's last member is done (a `runtime.slot_timer.SlotTimer`)."""

    def __init__(self, clock: SlotClock, *, slowdown: float = 1.0, hold: bool = True) -> None:
        self.clock = clock
        """What measures the slots, injection included."""
        self.slowdown = slowdown
        """Hold each slot this many times as long (1.0: this rank is not slowed)."""
        self.hold = hold
        """Wait for the group's last member after each multi-rank slot (every rank of a job with injection)."""

    @contextlib.contextmanager
    def slot(self, key: tuple[int, ...], group: dist.ProcessGroup | PeerRing | None = None) -> Iterator[None]:
        """The clock's slot under `key`, stretched by `slowdown`, held until `group`'s (this rank's communicator
        for the slot's group) last member is done."""
        with self.clock.slot(key, group):
            with self._stretched():
                yield
            self._wait_for(group)

    def end_step(self, tag: object) -> None:
        """The clock's `end_step`."""
        self.clock.end_step(tag)

    def take(self) -> tuple[object, list[tuple[tuple[int, ...], float]], float] | None:
        """The clock's `take`: the slots as measured, injection included."""
        return self.clock.take()

    @contextlib.contextmanager
    def _stretched(self) -> Iterator[None]:
        """Run the block, then wait (slowdown - 1) times as long as it took."""
        if self.slowdown <= 1.0:
            yield
            return
        if self.clock.device.type == "cuda":  # measure the slot's own work now, then hold the stream that long
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            time.sleep((self.slowdown - 1.0) * start.elapsed_time(end) / 1e3)
            return
        begin = time.perf_counter()
        yield
        time.sleep((self.slowdown - 1.0) * (time.perf_counter() - begin))

    def _wait_for(self, group: dist.ProcessGroup | PeerRing | None) -> None:
        """With `hold`, pass a token around the group's ring size - 1 times: no member leaves before the last
        one arrives."""
        if not self.hold or group is None or group.size() == 1:
            return
        token = torch.zeros(1, device=self.clock.device)
        for _ in range(group.size() - 1):
            token = start_shift(token, group).wait()


def timer_for_job(device: torch.device, slowdowns: Mapping[int, float]) -> SlotTimer:
    """This rank's slot timer in a job whose `slowdowns` (global rank -> factor, `DhpConfig.slowdowns`) are
    injected: the plain clock when there are none; else the clock slowed by this rank's own factor and holding
    its groups on every rank (a rank that did not would leave its group's token pass unanswered)."""
    clock = SlotClock(device)
    if not slowdowns:
        return clock
    return InjectedSlowdown(clock, slowdown=slowdowns.get(dist.get_rank(), 1.0), hold=True)
