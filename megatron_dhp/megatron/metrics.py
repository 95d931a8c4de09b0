"""dhp's numbers where Megatron users look: its writers, at its intervals, numbered by its iterations.

Megatron-LM keeps a TensorBoard `SummaryWriter` and the `wandb` module on the last rank only
(`megatron.training.global_vars`, set when --tensorboard-dir or --wandb-project is given) and writes its scalars
there every --tensorboard-log-interval iterations, its log line every --log-interval (`training_log`).
Megatron-Bridge keeps the same two on its `GlobalState` (`bridge.seams` hands them over). Every rank runs the
same plan, so the rank that holds the writers writes dhp's scalars (`integration.step_metrics`) beside
Megatron's with no collective, and rank 0 prints the plan line; a `StepLog` decides when, per data iterator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_dhp.errors import DhpError
from megatron_dhp.integration.step_metrics import StepMetrics
from megatron_dhp.plan.plan import Plan

if TYPE_CHECKING:
    from megatron_dhp.closed_loop.loop import ClosedLoop


@dataclass(frozen=True)
class Writers:
    """Megatron's writers on the rank that holds them; both None on every other rank (and without any)."""

    tensorboard: Any = None
    """A `torch.utils.tensorboard.SummaryWriter`: `add_scalar(name, value, iteration)`, `add_text`."""
    wandb: Any = None
    """The `wandb` module after `wandb.init`: `log({name: value}, iteration)`, `config.update`."""

    @classmethod
    def of_megatron_lm(cls) -> Writers:
        """Megatron-LM's own (`get_tensorboard_writer()`, `get_wandb_writer()`); none without a Megatron-LM
        checkout (megatron-core alone has no training loop to log)."""
        try:
            from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        except ImportError:
            return cls()
        return cls(get_tensorboard_writer(), get_wandb_writer())

    def __bool__(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def scalars(self, values: Mapping[str, float], iteration: int) -> None:
        """Write `values` at `iteration`, as Megatron's `training_log` writes its own."""
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, iteration)
        if self.wandb is not None:
            self.wandb.log(dict(values), iteration)

    def text(self, name: str, text: str, iteration: int) -> None:
        """Write a fact of the run that is no number: TensorBoard's text tab, W&B's run config."""
        if self.tensorboard is not None:
            self.tensorboard.add_text(name, text, iteration)
        if self.wandb is not None:
            self.wandb.config.update({name: text}, allow_val_change=True)


@dataclass
class StepLog:
    """When one data iterator's steps are logged, and where.

    A step handed out advances `iteration`; the plan line is due when it is a multiple of `log_interval`, the
    scalars when it is one of `writer_interval` (Megatron's own tests on its iteration). The training iterator
    starts at Megatron's iteration (`args.iteration`, loaded with a checkpoint: a resumed run goes on numbering
    where it stopped); a rerun's replay hands out no step, so it does not count. Evaluation's iterators count
    their own steps and write no scalars.
    """

    log_plans: bool = True
    """Print the plan line at all (`DhpConfig.log_plans`)."""
    prints: bool = False
    """This rank prints it (rank 0)."""
    log_interval: int = 1
    """The plan line every this many iterations (Megatron's --log-interval)."""
    writer_interval: int = 1
    """The scalars every this many iterations (Megatron's --tensorboard-log-interval)."""
    iteration: int = 0
    """The iteration the last step handed out runs as, numbered as Megatron's `training_log` numbers it (the first
    step of a fresh run is 1)."""
    writers: Writers = field(default_factory=Writers)
    metrics: StepMetrics = field(default_factory=StepMetrics)

    def __post_init__(self) -> None:
        for name in ("log_interval", "writer_interval"):
            if getattr(self, name) < 1:
                raise DhpError(f"{name} {getattr(self, name)} must be at least 1 (log every that many iterations)")

    def advance(self) -> None:
        """Count a step handed out."""
        self.iteration += 1

    @property
    def line_due(self) -> bool:
        """Whether this rank prints the plan line of the step just handed out."""
        return self.log_plans and self.prints and self.iteration % self.log_interval == 0

    @property
    def scalars_due(self) -> bool:
        """Whether this rank writes the scalars of the step just handed out."""
        return bool(self.writers) and self.iteration % self.writer_interval == 0

    def write(self, plan: Plan, *, loop: ClosedLoop | None = None, plan_wait_s: float | None = None) -> None:
        """Write the step's scalars (`StepMetrics.of`) at `iteration`."""
        self.writers.scalars(self.metrics.of(plan, loop=loop, plan_wait_s=plan_wait_s), self.iteration)
