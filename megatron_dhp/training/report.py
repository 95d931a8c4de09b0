"""Rank 0's view of a run: one log line per step above a progress bar (rich)."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from megatron_dhp.training.loop import StepRecord


class StepReporter:
    """Prints each `StepRecord`'s line and advances the bar; use it as a context manager."""

    def __init__(self, *, total_steps: int, first_step: int, title: str, lines: bool = True, plans: bool = True) -> None:
        self.total_steps = total_steps
        self.lines = lines
        self.plans = plans
        self.console = Console(highlight=False)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True)
        self.task = self.progress.add_task(title, total=total_steps, completed=first_step)

    def __enter__(self) -> StepReporter:
        self.progress.start()
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.progress.stop()

    def __call__(self, record: StepRecord) -> None:
        """Log one finished step."""
        if self.lines:
            self.console.print(record.line(self.total_steps, plan=self.plans), soft_wrap=True)
        self.progress.update(self.task, completed=record.step, description=f"loss {record.loss:.3f}")

    def note(self, text: str) -> None:
        """A free-form line above the bar (start-up, checkpoints)."""
        self.console.print(text, soft_wrap=True)
