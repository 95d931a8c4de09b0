"""What the step engine's walk times its slots with: a protocol the runtime owns, so that it never imports the
closed loop that implements it (`closed_loop.slot_clock.SlotClock` measures; `closed_loop.injection` wraps it
where `slow_ranks` injects a slowdown; `closed_loop.injection.timer_for_job` picks).

The walk runs each slot inside `slot` and closes the step with `end_step`; the next length gather takes the
finished step (`take`) and hands it to the closed loop's `Feedback` (`runtime.engine`). Under pipeline
parallelism megatron-core's 1F1B runs the slots, and they are not timed (`UNTIMED_UNDER_PP`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch.distributed as dist

    from megatron_dhp.runtime.attention.comm import PeerRing

UNTIMED_UNDER_PP = "megatron-core's 1F1B runs the slots under pipeline parallelism, and megatron-dhp does not time them"
"""Why nothing is measured with pipeline_stages > 1 (`runtime.engine.StepEngine.run`: the walk, whose slots a
timer times, is not what runs the step there): the closed loop is off (`closed_loop.loop.ClosedLoop.off_note`)
and fault injection is refused (`closed_loop.injection.check_injection`)."""


class SlotTimer(Protocol):
    """Seconds of this rank's slots, step by step; `take` hands over the last finished step's."""

    def slot(self, key: tuple[int, ...],
             group: dist.ProcessGroup | PeerRing | None = None) -> AbstractContextManager[None]:
        """Time the slot run inside the block under `key` (its microbatch's sample ids); `group` is this rank's
        communicator for the slot's group."""
        ...

    def end_step(self, tag: object) -> None:
        """Close the step's list of slots under `tag` (the walk calls it after its last slot, with the plan)."""
        ...

    def take(self) -> tuple[object, list[tuple[tuple[int, ...], float]], float] | None:
        """The last finished step's tag, (key, seconds) of its slots in walk order, and the seconds from its
        first slot's start to its last slot's end, once (None: nothing new yet)."""
        ...
