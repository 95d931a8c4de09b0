"""How long each of this rank's slots took: the closed loop's measuring (a `runtime.slot_timer.SlotTimer`).

On a CPU a slot is wall time around its forward and backward. On a GPU it is CUDA events on the current
stream, read when the engine next asks (a step later, when they have long completed): nothing synchronises
the step. A slot of a multi-rank group includes waiting inside it for the group's slowest rank, which is
why the deciding side takes each rank's fastest group as its own speed (`closed_loop.loop`).

The clock only measures. Fault injection (`slow_ranks`) is a wrapper around it that a job puts on only when
it injects (`closed_loop.injection`). Under pipeline parallelism nothing is timed
(`runtime.slot_timer.UNTIMED_UNDER_PP`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class SlotClock:
    """Seconds of this rank's slots, step by step; `take` hands over the last finished step's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._current: list = []
        self._finished: tuple[object, list] | None = None

    @contextlib.contextmanager
    def slot(self, key: tuple[int, ...], group: object = None) -> Iterator[None]:
        """Time the slot run inside the block under `key` (its microbatch's sample ids); `group` is not used
        (the protocol passes it for the wrappers that hold a group, `closed_loop.injection`)."""
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._current.append((key, (start, end)))
            return
        begin = time.perf_counter()
        yield
        self._current.append((key, (begin, time.perf_counter())))

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
