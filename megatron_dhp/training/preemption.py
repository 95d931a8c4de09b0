"""What a rank does when the job is told to stop (a scheduler's preemption) or its launcher goes away.

A cluster scheduler stops a job with SIGTERM (preemption, `scancel`, the end of a time limit), sometimes
SIGHUP. A rank catches either, finishes the step it is in, and at the step boundary every rank learns of it
from the step's record gather (no extra collective): they save a checkpoint when the run has `train.save`
(Megatron-LM's `--exit-signal-handler` does the same) and return, so the job ends with its exit status
128 + the signal's number and nothing lost. The signal may reach one rank or all: one is enough.

A rank also watches the process that started it (`launch.ranks.exit_with_parent`), so none outlives its
launcher.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class StopRequest:
    """The stop signal this rank received (0: none yet), set by its handler, read at each step boundary."""

    def __init__(self) -> None:
        self.signal = 0

    def install(self) -> StopRequest:
        """Catch `STOP_SIGNALS` from now on (call from the main thread); returns self."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._caught)
        return self

    def _caught(self, signum: int, frame: object) -> None:
        self.signal = signum


def signal_name(signum: int) -> str:
    """`SIGTERM` for 15 (the number where the platform has no name for it)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
