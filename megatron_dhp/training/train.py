"""`train(config)`: the whole job, from spawning ranks to rank 0's per-step records and their summary."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.errors import DhpError, DhpRunError
from megatron_dhp.training.config import TrainConfig
from megatron_dhp.training.job import run_on_ranks
from megatron_dhp.training.loop import StepRecord


def steps_within(predicted: Sequence[float], measured: Sequence[float], tolerance: float = 0.15) -> int:
    """Steps whose predicted forward+backward time is within `tolerance` of the measured one."""
    return sum(abs(p / m - 1) <= tolerance for p, m in zip(predicted, measured))


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports: its records (a resumed run's start at the resumed step) and set-up."""

    records: list[StepRecord]
    planner: str
    world_size: int
    domain_size: int
    static_cp: int
    """The CP size Megatron's static CP would use for this run's data (the `static` planner's)."""
    plans: list[dict]
    """The plan JSON of every step this run trained, in step order (for plots and comparisons)."""
    cost: CostConfig
    """The cost model the run planned and predicted with, on its live domain."""
    groups_at_startup: int
    """Multi-rank groups (communicators per domain) created at start-up: the group family."""

    @property
    def stopped_by(self) -> str:
        """The signal that stopped the run before `train.steps` (`SIGTERM`), or ''."""
        return self.records[-1].stopped_by if self.records else ""

    @property
    def median_step_s(self) -> float:
        """Median wall time of a step (the whole iteration); NaN when the run had no step to do."""
        return statistics.median(r.wall_s for r in self.records) if self.records else float("nan")

    @property
    def prediction_errors(self) -> list[float]:
        """(predicted - measured) / measured forward+backward time, per step."""
        return [(r.predicted_s - r.measured_s) / r.measured_s for r in self.records]

    def steps_within(self, tolerance: float = 0.15) -> int:
        """Steps whose predicted forward+backward time is within `tolerance` of the measured one."""
        return steps_within([r.predicted_s for r in self.records], [r.measured_s for r in self.records], tolerance)

    def summary_lines(self) -> list[str]:
        """A few lines for the end of a run: loss, times, how well the cost model predicted."""
        if not self.records:
            return ["no step to run (the checkpoint is already at train.steps)"]
        first, last = self.records[0], self.records[-1]
        errors = [abs(e) for e in self.prediction_errors]
        skipped = [str(r.step) for r in self.records if r.skipped]
        median = statistics.median
        return [
            f"{self.planner} on {self.world_size} ranks: steps {first.step}-{last.step}, loss {first.loss:.4f} -> "
            f"{last.loss:.4f}",
            f"step time median {self.median_step_s:.3f}s ({median(r.tokens_per_s for r in self.records):,.0f} tok/s); "
            f"forward+backward median pred {median(r.predicted_s for r in self.records):.3f}s meas "
            f"{median(r.measured_s for r in self.records):.3f}s; sync {median(r.sync_s for r in self.records):.3f}s, "
            f"optimizer {median(r.optimizer_s for r in self.records):.3f}s, waiting for the plan "
            f"{median(r.plan_wait_s for r in self.records) * 1e3:.1f} ms",
            f"cost model vs measured: median |error| {100 * median(errors):.1f}%, max {100 * max(errors):.1f}%, "
            f"{self.steps_within()}/{len(errors)} steps within 15%",
            f"groups: {self.groups_at_startup} created at start-up, {last.groups_created} created after start-up",
            *([f"stopped by {self.stopped_by} after step {last.step}"] if self.stopped_by else []),
            *([f"{len(skipped)} steps skipped (non-finite loss or gradients): {', '.join(skipped[:10])}"
               f"{', ...' if len(skipped) > 10 else ''}"] if skipped else []),
        ]

    def to_dict(self) -> dict:
        """Plain JSON form (records as dicts)."""
        out = asdict(self)
        out["median_step_s"] = self.median_step_s
        return out


def train(config: TrainConfig, *, show: bool = True, lines: bool = True, timeout_s: float = float("inf")) -> TrainResult:
    """Run the configured job (spawning ranks unless under torchrun). With `show`, rank 0 draws a progress
    bar and, with `lines`, logs every step."""
    return run_on_ranks(_train_rank, config, show, lines, timeout_s=timeout_s)


def _train_rank(config: TrainConfig, show: bool, lines: bool) -> TrainResult:
    """One rank's run. Rank 0 holds the `--save` folder's lock from before the model is built to the end of
    the run, however it ends (a refusal, an error, a stop signal's save)."""
    import torch.distributed as dist

    from megatron_dhp.training.checkpoint import decided_on_rank0
    from megatron_dhp.training.save_lock import SaveLock

    lock = SaveLock(Path(config.train.save)) if config.train.save else None
    notes = decided_on_rank0(lock.acquire) if lock else []
    try:
        return _train_holding_the_folder(config, show, lines, notes)
    finally:
        if lock is not None and dist.get_rank() == 0:
            lock.release()


def _train_holding_the_folder(config: TrainConfig, show: bool, lines: bool, notes: list[str]) -> TrainResult:
    """Prepare the save folder (rank 0 decides, every rank follows), build, resume, train."""
    import torch.distributed as dist

    from megatron_dhp.training.checkpoint import SaveFolderStart, decided_on_rank0, prepare_save_folder
    from megatron_dhp.training.loop import Trainer

    run = config.train
    start = decided_on_rank0(lambda: prepare_save_folder(run)) if run.save else SaveFolderStart(run.load, [])
    trainer = Trainer(config)
    trainer.stop.install()
    if start.resume:
        trainer.resume(start.resume)
    notes = [*notes, *start.notes, *trainer.checkpointer.notes]
    records: list[StepRecord] = []
    plans: list[dict] = []

    def keep(record: StepRecord) -> None:
        records.append(record)
        plans.append(trainer.last_plan.to_dict())

    def result() -> TrainResult:
        return TrainResult(records, config.dhp.planner, dist.get_world_size(), trainer.domain.size,
                           trainer.static_cp, plans, trainer.cost, trainer.runtime.pool.at_startup)

    try:
        if show and dist.get_rank() == 0:
            from megatron_dhp.training.report import StepReporter

            title = f"{config.dhp.planner} on {dist.get_world_size()} ranks"
            with StepReporter(total_steps=config.train.steps, first_step=trainer.completed, title=title,
                              lines=lines, plans=config.dhp.log_plans) as reporter:
                for note in [trainer.describe(), *notes]:
                    reporter.note(note)
                trainer.train(on_step=lambda r: (keep(r), reporter(r)))
        else:
            trainer.train(on_step=keep)
    except DhpError as e:  # the steps that ran go back with it (for --json)
        raise DhpRunError(str(e), result()) from None
    return result()
