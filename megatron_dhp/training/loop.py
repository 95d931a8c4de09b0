"""The train loop: the step engine's planned steps, forward and backward per plan, reduce, optimizer step.

Per step t (the collectives' order is the engine's, `runtime/engine.py`):
1. the engine takes step t's plan (solved in the background while step t-1 trained), checks it on every
   rank, gathers step t+1's lengths and starts planning it, creates step t's groups and moves its tokens;
2. the microbatches run (`run_step`: the engine's walk, or under PP megatron-core's 1F1B over this
   position's slots, which the engine drives);
3. gradients are reduced over the domain (under PP inside `finalize_model_grads`, so in "meas"), the
   megatron-core optimizer steps, the step's numbers are gathered (loss and tokens from the last stage).

"meas" is what the plan predicts: the forward+backward makespan, from a barrier at the step's start to the
end of the slowest rank's last backward. Gradient sync and the optimizer are timed apart.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.integration.job_spec import JobSpec
from megatron_dhp.integration.step_runtime import build_step_runtime
from megatron_dhp.plan.plan import Plan, rank_speeds_text
from megatron_dhp.runtime.attention.comm import all_gather_single
from megatron_dhp.runtime.attention.kernels import describe
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.engine import StepEngine
from megatron_dhp.runtime.pipeline import check_pipeline
from megatron_dhp.runtime.step import run_step
from megatron_dhp.runtime.step_data import StepInputs
from megatron_dhp.solver import static_cp_size
from megatron_dhp.training.checkpoint import Checkpointer
from megatron_dhp.training.config import TrainConfig
from megatron_dhp.training.data import TokenPipeline
from megatron_dhp.training.model import build_model, build_optimizer
from megatron_dhp.training.preemption import StopRequest, signal_name


@dataclass(frozen=True)
class StepRecord:
    """One finished step as every rank sees it (sums over the domain, times as the slowest rank's)."""

    step: int
    """1-based."""
    loss: float
    """Mean per-token loss over the global batch (before this step's update)."""
    grad_norm: float
    lr: float
    num_samples: int
    num_tokens: int
    groups: str
    """Group sizes of the plan as `countxsize`, e.g. `2x1 1x2`."""
    groups_created: int
    """Communicators created after start-up so far (0 while plans stay in the group family made at start-up)."""
    groups_p2p: int
    """The plan's multi-rank groups outside the family, which ran on the domain's communicator (comm mixed, p2p)."""
    num_microbatches: int
    predicted_s: float
    """The plan's forward+backward makespan under the cost model."""
    measured_s: float
    """The same makespan as measured: step-start barrier to the slowest rank's last backward."""
    sync_s: float
    """Gradient reduction over the domain."""
    optimizer_s: float
    plan_wait_s: float
    """Time the step waited for its plan (near 0 when planning overlaps the previous step)."""
    wall_s: float
    """The whole iteration on the slowest rank: planning wait, dispatch, compute, sync, optimizer."""
    slow_ranks: str = ""
    """The ranks the plan was made for as slow, with their speeds (`r3@0.50`), from the closed loop or the
    stated speeds; empty when all ran at one speed."""
    stopped_by: str = ""
    """The signal (`SIGTERM`) some rank received during the step: the run saves and stops after it."""
    skipped: str = ""
    """What was NaN or infinite (`loss`, `gradients`) when `train.on_nonfinite: skip` dropped the step's
    update; empty for a step the optimizer applied."""

    @property
    def tokens_per_s(self) -> float:
        """Real tokens of the global batch per second of wall time."""
        return self.num_tokens / self.wall_s

    def line(self, total_steps: int, *, plan: bool = True) -> str:
        """The step's log line; `plan` adds the plan's groups and microbatches (`dhp.log_plans`)."""
        p2p = f", {self.groups_p2p} on p2p" if self.groups_p2p else ""
        groups = f"groups {self.groups} ({self.groups_created} created{p2p}) | {self.num_microbatches} mb | " if plan else ""
        groups += f"slow {self.slow_ranks} | " if self.slow_ranks else ""
        groups += f"skipped: non-finite {self.skipped} | " if self.skipped else ""
        return (f"step {self.step:>{len(str(total_steps))}}/{total_steps} | loss {self.loss:.4f} | "
                f"{self.num_tokens:,} tok | {self.tokens_per_s:,.0f} tok/s | {groups}pred {self.predicted_s:.3f}s "
                f"meas {self.measured_s:.3f}s | sync {self.sync_s:.3f}s opt {self.optimizer_s:.3f}s | "
                f"step {self.wall_s:.3f}s")


StepCallback = Callable[[StepRecord], None]


@dataclass(frozen=True)
class RankReport:
    """What one rank reports of a step: gathered as a row per rank, summed over the loss ranks (loss, tokens) and
    taken at the slowest rank (times) or any rank (a stop signal)."""

    loss_sum: float
    num_tokens: float
    measured_s: float
    """Its forward and backward: what the plan predicts."""
    sync_s: float
    """Its gradient reduction after the walk (0 under 1F1B, which reduces inside)."""
    optimizer_s: float
    plan_wait_s: float
    wall_s: float
    stop_signal: float
    """The signal (`SIGTERM`) this rank caught during the step, 0 if none: the run saves and stops after it."""


class Trainer:
    """Everything one rank trains with; build it after `init_distributed` on every rank."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.domain = DynamicDomain.from_parallel_state(timeout=timedelta(seconds=config.train.timeout_s))
        self.spec = JobSpec.for_domain(
            config.dhp, self.domain, world_size=dist.get_world_size(), tensor_parallel=config.train.tp,
            sequence_parallel=config.model.sequence_parallel, pipeline_stages=config.train.pp,
            virtual_stages=config.train.vpp,
            model=config.model.memory(tensor_parallel=config.train.tp, pipeline_stages=config.train.pp))
        """The job's sizes and token cap: a sample may fill one microbatch of the whole domain (`TokenCaps`)."""
        self.cost = self.spec.cost
        capacity = self.spec.caps.longest_sample
        self.pipeline = TokenPipeline(config.data, vocab_size=config.model.vocab_size,
                                      capacity=capacity, truncate=config.dhp.truncate,
                                      vision=config.vision if config.vision.layers else None)
        longest = self.pipeline.longest(config.train.steps)
        if longest > config.model.max_sequence_length:
            raise DhpError(f"the data holds a {longest}-token sample but model.max_sequence_length is "
                           f"{config.model.max_sequence_length}; raise it (RoPE table size)")
        self.longest = longest
        """The run's longest sample: what Megatron's static CP is sized for (the static planner's CP)."""
        self.static_cp = static_cp_size(longest, self.cost.domain)
        self.runtime = build_step_runtime(self.spec, self.domain, dataset_max_tokens=longest)
        if config.train.pp > 1:
            check_pipeline(self.domain)
        self.loss_ranks = _last_stage_domain()
        """The global ranks whose losses and token counts make the batch's: this TP coordinate's last stage."""
        self.model = build_model(config.model, seed=config.train.seed, layer_spec=config.dhp.layer_spec,
                                 vision=config.vision, virtual=config.train.vpp)
        self.chunks = self.model if isinstance(self.model, list) else [self.model]
        """This rank's stage, or its model chunks under interleaved pipelining."""
        self.optimizer, self.scheduler = build_optimizer(self.model, config.train)
        self.checkpointer = Checkpointer(config, world_size=dist.get_world_size())
        self.completed = 0
        """Steps done so far (the data position: the next batch is batch `completed`)."""
        self.skipped_in_a_row = 0
        """Steps dropped one after the other as non-finite (`train.max_skipped_steps` bounds them)."""
        self.last_plan: Plan | None = None
        self.stop = StopRequest()
        """A stop signal this rank caught (`StopRequest.install`): the run saves and stops after the step."""

    def describe(self) -> str:
        """One line on what runs: model, ranks, planner, memory cap, cost model, data."""
        c, n = self.config, sum(p.numel() for chunk in self.chunks for p in chunk.parameters())
        pp = f", PP {c.train.pp}" if c.train.pp > 1 else ""
        pp += f" x VPP {c.train.vpp}" if c.train.vpp > 1 else ""
        tower = f"ViT {c.vision.layers}x{c.vision.hidden_size} + " if c.vision.layers else ""
        return (f"{tower}GPT {c.model.num_layers}x{c.model.hidden_size} ({n / 1e3:.0f}k params) | "
                f"{dist.get_world_size()} ranks (domain {self.domain.size}, TP {c.train.tp}{pp}) | planner "
                f"{c.dhp.planner} | M {c.dhp.max_tokens_per_rank} tokens/rank | cost {c.dhp.cost_name} ({self.cost.kind}) | "
                f"data {c.data.source} x{c.data.length_scale:g}, {c.data.global_batch} samples/step, longest "
                f"{self.longest} (static CP {self.static_cp}) | {self.runtime.policy.summary()} | "
                f"{describe(c.dhp.attention_backend, self.domain.device)}, {self.runtime.kernels} | "
                f"from step {self.completed + 1} of {c.train.steps}")

    def resume(self, directory: str) -> int:
        """Load the latest checkpoint of `directory` into this rank; returns the steps it had completed."""
        self.completed = self.checkpointer.load(directory, self.model, self.optimizer, self.scheduler)
        return self.completed

    def train(self, on_step: StepCallback | None = None) -> list[StepRecord]:
        """Run from the current data position to `train.steps`, checkpointing as configured."""
        records = []
        for record in self.steps():
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records

    def steps(self) -> Iterator[StepRecord]:
        """Train step after step up to `train.steps`, yielding each record (lets a caller interleave runs)."""
        run = self.config.train
        position, size = self.domain.position, self.domain.size
        batches = (self.pipeline.local_samples(k, position, size) for k in range(self.completed, run.steps))
        engine = self.runtime.engine(source=lambda: next(batches, None), lookahead=True)
        try:
            while True:
                start = time.perf_counter()
                inputs = engine.next()
                if inputs is None:
                    break
                record = self._step(engine, inputs, start)
                if run.save and (self.completed == run.steps or record.stopped_by or
                                 (run.save_interval and self.completed % run.save_interval == 0)):
                    self.checkpointer.save(run.save, self.completed, self.model, self.optimizer, self.scheduler)
                yield record
                if record.stopped_by:  # every rank sees the same record: all stop after the same step
                    break
        finally:
            self.runtime.planner.close()

    def _step(self, engine: StepEngine, inputs: StepInputs, start: float) -> StepRecord:
        """Train the step the engine dispatched since `start` (the data position's, `completed`); its record."""
        plan = inputs.plan
        self.last_plan = plan
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.scheduler.step(1)  # the learning rate of step k is the schedule's value at k
        lr = self.optimizer.param_groups[0]["lr"]
        dist.barrier(group=self.domain.group)
        t0 = time.perf_counter()
        result = run_step(engine, self.model, inputs)  # the engine finishes the gradients (inside 1F1B under PP)
        t2 = time.perf_counter()
        t1 = t2 - engine.finish_s  # the walk's end: what the plan predicts is forward and backward
        step = self.completed + 1
        skipped = self._nonfinite(step, result.loss_sum)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        limit = self.config.train.max_skipped_steps
        if self.skipped_in_a_row > limit:
            raise DhpError(f"steps {step - limit}-{step}: non-finite {skipped} in {limit + 1} steps in a row, more than "
                           f"train.max_skipped_steps = {limit}: the run diverged and skipping does not recover it; "
                           f"lower train.lr = {self.config.train.lr:g} (or lengthen train.warmup_steps)")
        ok, grad_norm = (True, float("nan")) if skipped else self.optimizer.step()[:2]
        t3 = time.perf_counter()
        if not ok:
            raise DhpError(f"the optimizer skipped step {step} (non-finite gradients); lower train.lr")
        self.completed = step
        mine = RankReport(result.loss_sum, result.num_tokens, t1 - t0, t2 - t1, t3 - t2, engine.plan_wait_s,
                          t3 - start, self.stop.signal)
        record = self._record(plan, mine, step, lr, grad_norm, result.global_loss_tokens, engine.groups_on_p2p(plan))
        return replace(record, skipped=skipped) if skipped else record

    def _nonfinite(self, step: int, loss_sum: float) -> str:
        """What is NaN or infinite in this step before the optimizer applies it (`loss`, `gradients`; '' when
        nothing), agreed over the world; under `train.on_nonfinite: stop` a `DhpError` naming the step instead.
        Collective: one flag pair over the host control plane. It reads the reduced gradient buffers of
        megatron-core's DDP rather than the optimizer's norm, which `step` computes and applies in one call."""
        grads = [b.grad_data for chunk in self.chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
        group, device = self.domain.control_plane(world=True)
        finite = torch.stack([g.isfinite().all() for g in grads]).all() if grads else torch.tensor(True)
        flags = torch.tensor([not math.isfinite(loss_sum), 0.0], device=device)
        flags[1] = finite.logical_not().to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        found = " and ".join(what for what, bad in zip(("loss", "gradients"), flags.tolist()) if bad)
        if found and self.config.train.on_nonfinite == "stop":
            raise DhpError(f"step {step}: non-finite {found} (NaN or infinite: the run diverged); stopped before "
                           f"the optimizer applied the step, nothing of it saved. Lower train.lr = "
                           f"{self.config.train.lr:g} (or lengthen train.warmup_steps), or pass --on-nonfinite skip "
                           "to drop such steps")
        return found

    def _record(self, plan: Plan, mine: RankReport, step: int, lr: float, grad_norm: float | None,
                loss_tokens: int, groups_p2p: int) -> StepRecord:
        """Sum the losses over the last stage's domain, take the slowest rank's times over the world. Collective."""
        world = dist.get_world_size()
        group, device = self.domain.control_plane(world=True)  # read on the host: gloo beside NCCL
        local = torch.tensor(astuple(mine), dtype=torch.float64, device=device)
        table = local.new_empty(world * local.numel())
        all_gather_single(table, local, group=group)
        table = table.view(world, -1).cpu()
        ours = RankReport(*table[list(self.loss_ranks)].sum(dim=0).tolist())  # the batch's loss and tokens
        slowest = RankReport(*table.max(dim=0).values.tolist())  # the slowest rank's times, any rank's signal
        num_tokens = int(ours.num_tokens)
        assert num_tokens == sum(s.tokens for s in plan.samples), "every token of the batch runs exactly once"
        sizes = Counter(g.size for g in plan.groups)
        return StepRecord(
            step=step,
            loss=ours.loss_sum / loss_tokens,
            grad_norm=float(grad_norm or 0.0),
            lr=float(lr),
            num_samples=len(plan.samples),
            num_tokens=num_tokens,
            groups=" ".join(f"{n}x{d}" for d, n in sorted(sizes.items())),
            groups_created=self.runtime.pool.created,
            groups_p2p=groups_p2p,
            num_microbatches=plan.num_microbatches,
            predicted_s=float(plan.predicted_step_time_s or 0.0),
            measured_s=slowest.measured_s,
            sync_s=slowest.sync_s,
            optimizer_s=slowest.optimizer_s,
            plan_wait_s=slowest.plan_wait_s,
            wall_s=slowest.wall_s,
            slow_ranks=rank_speeds_text(plan.slow_ranks()),
            stopped_by=signal_name(int(slowest.stop_signal)) if slowest.stop_signal else "",
        )


def _last_stage_domain() -> tuple[int, ...]:
    """The domain of this rank's TP coordinate at the last pipeline stage (this rank's domain without PP),
    where the loss is computed. Collective over the world."""
    from megatron.core import parallel_state

    mine = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.is_pipeline_last_stage())
    everyone: list[tuple[int, bool]] = [(0, False)] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return tuple(r for r, (tp, last) in enumerate(everyone) if tp == mine[0] and last)
