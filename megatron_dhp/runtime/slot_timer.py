"""How long each of this rank's slots took: the closed loop's measurement (`integration.closed_loop`).

On a CPU a slot is wall time around its forward and backward. On a GPU it is CUDA events on the current
stream, read when the engine next asks (a step later, when they have long completed): nothing synchronises
the step. A slot of a multi-rank group includes waiting inside it for the group's slowest rank, which is
why the planner's side takes each rank's fastest group as its own speed.

Fault injection (`slowdown` > 1, for tests and benchmarks): the rank holds each slot that many times as
long, waiting after the slot's own work, as a throttled GPU would; the results do not change. Every rank of
such a job (`hold`) then waits at the end of each multi-rank slot for the group's last member, as a
throttled GPU holds its group inside the collectives (without it the others would leave during the wait).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from megatron_dhp.runtime.attention.comm import PeerRing, start_shift


class SlotTimer:
    """Seconds of this rank's slots, step by step; `take` hands over the last finished step's."""

    def __init__(self, device: torch.device, *, slowdown: float = 1.0, hold: bool = False) -> None:
        self.device = device
        self.slowdown = slowdown
        """Hold each slot this many times as long (1.0: no injection)."""
        self.hold = hold
        """Wait for the group's last member after each multi-rank slot (every rank of a job with injection)."""
        self._cuda = device.type == "cuda"
        self._current: list = []
        self._finished: tuple[object, list] | None = None

    @classmethod
    def for_job(cls, device: torch.device, slowdowns: Mapping[int, float]) -> SlotTimer:
        """This rank's timer in a job whose `slowdowns` (global rank -> factor) are injected: slowed by its own
        factor, and holding its groups on every rank as soon as any rank is slowed (a rank that did not would
        leave its group's token pass unanswered)."""
        return cls(device, slowdown=slowdowns.get(dist.get_rank(), 1.0), hold=bool(slowdowns))

    @contextlib.contextmanager
    def slot(self, key: tuple[int, ...], group: dist.ProcessGroup | PeerRing | None = None) -> Iterator[None]:
        """Time the slot run inside the block under `key` (its microbatch's sample ids), stretched by `slowdown`,
        with `hold` until `group`'s (this rank's communicator for the slot's group) last member is done."""
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            if self.slowdown > 1.0:  # injection only: measure it now, then hold the stream that much longer
                end.record()
                end.synchronize()
                time.sleep((self.slowdown - 1.0) * start.elapsed_time(end) / 1e3)
            self._wait_for(group)
            end.record()
            self._current.append((key, (start, end)))
            return
        begin = time.perf_counter()
        yield
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - begin))
        self._wait_for(group)
        self._current.append((key, (begin, time.perf_counter())))

    def _wait_for(self, group: dist.ProcessGroup | PeerRing | None) -> None:
        """With `hold`, pass a token around the group's ring size - 1 times: no member leaves before the last
        one arrives."""
        if not self.hold or group is None or group.size() == 1:
            return
        token = torch.zeros(1, device=self.device)
        for _ in range(group.size() - 1):
            token = start_shift(token, group).wait()

    def end_step(self, tag: object) -> None:
        """Close the step's list of slots under `tag` (the walk calls it after its last slot, with the plan)."""
        self._finished, self._current = (tag, self._current), []

    def take(self) -> tuple[object, list[tuple[tuple[int, ...], float]], float] | None:
        """The last finished step's tag, (key, seconds) of its slots in walk order, and the seconds from its
        first slot's start to its last slot's end (gaps between slots included), once (None: nothing new, or
        its CUDA events have not completed yet; then it stays for the next call)."""
        if self._finished is None:
            return None
        tag, slots = self._finished
        if not slots:
            self._finished = None
            return tag, [], 0.0
        if self._cuda:
            if not all(end.query() for _, (_, end) in slots):
                return None
            seconds = [(key, start.elapsed_time(end) / 1e3) for key, (start, end) in slots]
            span = slots[0][1][0].elapsed_time(slots[-1][1][1]) / 1e3
        else:
            seconds = [(key, end - begin) for key, (begin, end) in slots]
            span = slots[-1][1][1] - slots[0][1][0]
        self._finished = None
        return tag, seconds, span
