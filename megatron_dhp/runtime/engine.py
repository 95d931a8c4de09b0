"""One step from this rank's samples to finished backward; every entry point runs its steps through here.

`StepEngine` owns the order of a step's collectives, which must be the same on every rank of the world:

1. **gather** every sample's id, length and loss-token count over the domain (`collectives.gather_batch`),
   with each rank's report of its last timed step (the closed loop's `Feedback`: no collective of its own);
2. **plan** the gathered batch on global rank 0 only (a `PlanSource`, e.g. `integration.planning.JobPlanner`)
   and broadcast the plan to every rank (`collectives.broadcast_plan`), or take a plan given with the samples;
3. **check** that every rank holds the same valid plan (`collectives.check_plan`), and that the job's attention
   runs its shards (`check_shares`: uneven ones not under TransformerEngine's);
4. **read ahead** (streamed steps): gather the next step's lengths and start planning it in the background
   on rank 0, so the planner never stalls a step (its broadcast waits for the step that asks for it);
5. **prepare** the plan's groups (`GroupPool.prepare`, world-collective) unless the comm policy runs any group
   without a communicator of its own (`CommPolicy.any_group`); a group talks as the policy's `transport` says
   (`p2p`: a `PeerRing` on the domain's communicator);
6. **move** the tokens so each rank holds its zigzag shards (`dispatch.move_tokens`), and a multimodal
   batch's pixels to the ranks that encode them (`vision.move_images`, by the plan's encoder placement);
7. **walk** this rank's work list (`slots.work_items`: microbatches, phase barriers, idle slots) and run
   each microbatch's forward and backward, which the caller supplies (`MicrobatchWork`), each slot timed
   by the `SlotTimer` when there is one.

The walk is the seam a pipeline schedule replaces: it only needs the work list and each slot's context.

Steps 2 and 6 and each slot's attention metadata run inside NVTX ranges on a GPU (`runtime.nvtx`), so a
profiler's timeline names the host work a step waits on.

Loss normalisation, the one rule: a microbatch's loss is the *sum* of its masked per-token losses, its
token count is its loss tokens, and the step's gradient is divided exactly once by the loss-token count of
the global batch (`StepInputs.num_loss_tokens`, known from the gather before any microbatch runs) while
the reduction over the domain sums. Who divides is the work's choice: the plain runner
(`step.run_step`) scales each backward by 1 / that count; the Megatron-LM schedule leaves it to megatron-
core's `finalize_model_grads` with the token count its loss function reports. Either way the gradient is
the mean over every loss token of the global batch, exactly as one process computes it.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.comm import DOMAIN_COMMS, CommPolicy
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.attention.comm import PeerRing
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.collectives import (
    PLANNING_RANK,
    broadcast_plan,
    check_plan,
    check_world,
    gather_batch,
)
from megatron_dhp.runtime.dispatch import move_tokens
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.group_pool import GroupPool
from megatron_dhp.runtime.nvtx import MOVE_TOKENS, PLAN_WAIT, nvtx_range
from megatron_dhp.runtime.pipeline import run_1f1b
from megatron_dhp.runtime.slot_timer import SlotTimer
from megatron_dhp.runtime.slots import (
    PHASE_BARRIER,
    aligned_slot_rows,
    last_backward_shared,
    pipeline_work,
    work_items,
)
from megatron_dhp.runtime.step_data import GatheredBatch, MicrobatchInputs, StepInputs, TokenSample
from megatron_dhp.runtime.vision import move_images
from megatron_dhp.workload.sample import Batch


class PlanSource(Protocol):
    """Plans gathered batches; `prefetch` may start one in the background (`integration.planning.JobPlanner`).

    The engine calls both on global rank 0 only and broadcasts the plan, so a planning need not be
    deterministic across ranks and holds no collective of its own."""

    def plan(self, batch: Batch) -> Plan:
        """The plan of `batch`."""
        ...

    def prefetch(self, batch: Batch) -> None:
        """Start planning `batch`, which a later `plan` asks for (may do nothing)."""
        ...


class Feedback(Protocol):
    """The closed loop's planning side (`closed_loop.loop.ClosedLoop`): turns this rank's measured slots
    into its report, and takes every rank's reports in. The engine calls both on every rank."""

    width: int
    """The floats of a report, the same on every rank (the length gather carries that many per rank)."""

    def report(self, plan: Plan, position: int, slots: Sequence[tuple[tuple[int, ...], float]],
               span: float) -> tuple[float, ...]:
        """This rank's report of a step it ran under `plan` from its slots' (sample ids, seconds) and their
        span, first start to last end (at most `width` floats)."""
        ...

    def observe(self, reports: Sequence[Sequence[float]]) -> None:
        """Every position's report, as gathered with a step's lengths (NaN: nothing measured)."""
        ...


SampleSource = Callable[[], list[TokenSample] | None]
"""This rank's samples of the next step (a Megatron loader slice), or None when there are no more steps."""


@dataclass(frozen=True)
class Slot:
    """One microbatch as the walk hands it to the caller's forward."""

    inputs: MicrobatchInputs
    context: CPContext
    """Its layout and this rank's communicator for its group (reaches attention and RoPE via PackedSeqParams)."""
    index: int
    """0-based among this rank's microbatches of the step."""
    count: int
    """How many microbatches this rank runs in the step (the idle slot included)."""


class MicrobatchWork(Protocol):
    """What the caller runs per microbatch. The engine's walk calls `forward` then `backward` slot by slot;
    under pipeline parallelism megatron-core's 1F1B calls `forward_step` and runs the backward itself."""

    model: torch.nn.Module | list[torch.nn.Module]
    """The model (under PP this rank's stage; interleaved, its list of V model chunks) that 1F1B runs."""
    schedule_options: Mapping[str, object]
    """Further keyword arguments of megatron-core's 1F1B (`pipeline.run_1f1b`), e.g. `forward_only`."""

    def forward(self, slot: Slot) -> object:
        """Run the slot's microbatch forward."""
        ...

    def backward(self, output: object) -> None:
        """Run the backward of what `forward` returned (or nothing, e.g. in evaluation)."""
        ...

    def forward_step(self, slots: Iterator[Slot], stage: torch.nn.Module) -> tuple[object, Callable]:
        """1F1B's forward of the next slot (megatron's `forward_step_func`): the stage's output and the loss
        function the last stage applies to it."""
        ...

    def finish(self) -> None:
        """Finish the step's gradients after the walk (reduce them over the domain, as megatron-core's
        `finalize_model_grads`; nothing in evaluation). Under 1F1B the schedule finalizes them itself."""
        ...


@dataclass(frozen=True)
class OverlappedReduction:
    """A model whose gradient reduction overlaps the last backward (megatron DDP, `overlap_grad_reduce`)."""

    no_sync: Callable[[], AbstractContextManager]
    """Holds the reduction back while the microbatches before the last run."""
    start: Callable[[], None]
    """Starts it by hand when a barrier follows the rank's last backward."""


@dataclass(frozen=True)
class _Pending:
    """A step whose lengths are gathered (and whose plan may be solving in the background)."""

    local: list[TokenSample]
    gathered: GatheredBatch


class StepEngine:
    """This rank's steps: samples in, planned and dispatched `StepInputs` out, then the walk over them."""

    def __init__(
        self,
        domain: DynamicDomain,
        pool: GroupPool | None = None,
        planning: PlanSource | None = None,
        *,
        source: SampleSource | None = None,
        lookahead: bool = False,
        seq_multiple: int = 1,
        aligned_slots: bool = False,
        equal_rows: bool = False,
        policy: CommPolicy | None = None,
        backend: str = "auto",
        pipelined: bool = False,
        timer: SlotTimer | None = None,
        feedback: Feedback | None = None,
    ) -> None:
        if equal_rows and not aligned_slots:
            raise DhpError("equal slot rows need aligned slots (StepEngine(aligned_slots=True))")
        self.domain = domain
        self.pool = pool
        """Where the step's groups are created; None only moves tokens (`testing.dispatch`), nothing can run."""
        self.policy = policy
        """How each group talks and whether a step creates any (None: the engine only moves tokens)."""
        self.backend = backend
        """The local attention kernel (`runtime.attention.BACKENDS`)."""
        self.pipelined = pipelined
        """`run` drives megatron-core's 1F1B over this position's slots (pipeline parallelism) instead of the walk."""
        self.planning = planning
        self.source = source
        self.lookahead = lookahead
        """`next` gathers the following step and starts planning it before this step's tokens move."""
        self.seq_multiple = seq_multiple
        """Each sample's shard is padded to a multiple of this: the TP size under sequence parallelism."""
        self.aligned_slots = aligned_slots
        """Every position runs the same slots per phase (`slots.work_items`): needed with expert parallelism."""
        self.equal_rows = equal_rows
        """Every position holds the same rows in each aligned slot (`slots.aligned_slot_rows`): needed by
        megatron-core's allgather MoE dispatcher with expert parallelism."""
        self.slots_by_comm: Counter[str] = Counter()
        """The variant each slot ran, counted (under `mixed`: `allgather` on the family, `p2p` outside it)."""
        if policy is not None and pool is not None and not set(policy.startup_groups) <= set(pool.family):
            raise DhpError("the group pool lacks the comm policy's start-up groups; build it with "
                           "family=policy.startup_groups")
        self.timer = timer
        """Times each slot of the walk (the closed loop's measurement; None: nothing is timed)."""
        self.feedback = feedback
        """Gets this rank's report of its timed slots, which rides with the next length gather, and every
        rank's reports (None: no closed loop)."""
        self.plan_wait_s = 0.0
        """Seconds the last step waited for its plan, solve and broadcast (near 0 when planning overlapped the
        step before)."""
        self.finish_s = 0.0
        """Seconds the last step's `run` spent finishing its gradients after the walk (0 under 1F1B, which
        finishes inside the schedule)."""
        self._ahead: _Pending | None = None

    def next(self) -> StepInputs | None:
        """The source's next step, gathered, planned, checked, its groups prepared and tokens moved; None at
        the end of the source. Collective over the world."""
        current = self._ahead if self._ahead is not None else self._read()
        self._ahead = None
        if current is None:
            return None
        start = time.perf_counter()
        plan = self._plan(current.gathered.batch)
        self.plan_wait_s = time.perf_counter() - start
        return self._dispatch(current, plan, read_ahead=self.lookahead)

    def prepare(self, local: Sequence[TokenSample], plan: Plan | None = None) -> StepInputs:
        """One step of the given samples under `plan` (or planned now), without reading ahead. Collective.

        A given plan made for another domain size is rejected before any collective."""
        if plan is not None:
            check_world(plan, self.domain)
        current = self._gather(list(local))
        if plan is None:
            plan = self._plan(current.gathered.batch)
        return self._dispatch(current, plan, read_ahead=False)

    def run(self, inputs: StepInputs, work: MicrobatchWork, *, overlap: OverlappedReduction | None = None) -> list:
        """Run this rank's part of the step and finish its gradients: megatron-core's 1F1B over its slots when
        `pipelined` (which finalizes them with the model config's `finalize_model_grads_func`; returns 1F1B's
        loss reports), else the walk (`walk`) then `work.finish()` (returns []). Collective."""
        self.finish_s = 0.0
        if self.pipelined:
            check_chunks(inputs.plan, work.model)
            return run_1f1b(work.forward_step, self.pipeline_slots(inputs), work.model, **work.schedule_options)
        self.walk(inputs, work, overlap=overlap)
        start = time.perf_counter()
        work.finish()
        self.finish_s = time.perf_counter() - start
        return []

    def pipeline_slots(self, inputs: StepInputs) -> list[Slot]:
        """This position's 1F1B slots of a prepared step (`slots.pipeline_work`), each with its group's context."""
        # 1F1B starts the reduction at each position's last backward: equal slot counts make every position's
        # last slot idle or its group's last on every member (`slots.last_backward_shared`)
        aligned = self.aligned_slots or not last_backward_shared(inputs.plan, pipelined=True)
        work = pipeline_work(inputs, self.domain.position, aligned=aligned)
        return [self.slot(mb, index, len(work)) for index, mb in enumerate(work)]

    def walk(self, inputs: StepInputs, work: MicrobatchWork, *, overlap: OverlappedReduction | None = None) -> None:
        """Walk this rank's work list of the step: barriers over the domain, each slot's forward and backward.

        With `overlap` the reduction starts during the last backward, unless the plan has phase barriers (a
        reduction must not start before a barrier on the same ranks and every rank must issue the buckets in one
        order, so then all ranks start it after their last barrier) or some rank's last backward is not its
        group's last on every member (`slots.last_backward_shared`): then too every rank starts it after its
        walk. Without it the caller reduces.
        """
        items = work_items(inputs, self.domain.position, aligned=self.aligned_slots)
        count = sum(item is not PHASE_BARRIER for item in items)
        index = 0

        timed = self.timer.slot if self.timer is not None else lambda key, group: contextlib.nullcontext()

        def visit(item: MicrobatchInputs | None) -> None:
            nonlocal index
            if item is PHASE_BARRIER:
                dist.barrier(group=self.domain.group)
                return
            slot = self.slot(item, index, count)
            with timed(item.layout.sample_ids, slot.context.group):
                work.backward(work.forward(slot))
            index += 1

        # A variant on the domain's communicator shares it with the gradient reduction (Megatron's DP group):
        # NCCL needs every rank to issue both in one order, so the reduction waits for the walk, as after a barrier;
        # so it does when a rank's last backward is not its group peers' last (`slots.last_backward_shared`).
        deferred = (inputs.plan.phase_barrier or self.policy.any_group
                    or not last_backward_shared(inputs.plan, aligned=self.aligned_slots))
        with (overlap.no_sync if overlap is not None else contextlib.nullcontext)():
            for item in items if deferred else items[:-1]:
                visit(item)
        if not deferred:
            visit(items[-1])  # outside no_sync: the last backward starts the gradient reduction while it runs
        elif overlap is not None:
            overlap.start()
        if self.timer is not None:
            self.timer.end_step(inputs.plan)

    def groups_on_p2p(self, plan: Plan) -> int:
        """The plan's distinct multi-rank groups that run on the domain's communicator (`CommPolicy.transport`)."""
        return self.policy.on_domain(plan.multi_rank_groups())

    def slot(self, mb: MicrobatchInputs, index: int, count: int) -> Slot:
        """Microbatch `mb` as slot `index` of `count`, with this rank's communicator for its group as the policy's
        `transport` says: a `PeerRing` on the domain's communicator (the pool is not asked), else the pool's."""
        if self.policy is None:
            raise DhpError("this engine has no comm policy, so it only moves tokens; give StepEngine(policy=...)")
        comm = self.policy.transport(mb.group_ranks)
        self.slots_by_comm[comm] += 1
        group = PeerRing.in_domain(self.domain, mb.group_ranks) if comm in DOMAIN_COMMS else self.pool.get(mb.group_ranks)
        context = CPContext(layout=mb.layout, group=group, comm=comm, backend=self.backend, device=self.domain.device)
        return Slot(mb, context, index, count)

    def _dispatch(self, current: _Pending, plan: Plan, *, read_ahead: bool) -> StepInputs:
        check_world(plan, self.domain)
        check_plan(plan, current.gathered, self.domain)
        check_shares(plan, self.policy)
        if read_ahead:
            self._ahead = self._read()
            if self._ahead is not None and dist.get_rank() == PLANNING_RANK:
                self.planning.prefetch(self._ahead.gathered.batch)
        if self.pool is not None and self.policy is not None and not self.policy.any_group:
            self.pool.prepare(plan)  # finds the family's groups; creates others only when planners may form them
        rows = aligned_slot_rows(plan, self.seq_multiple) if self.equal_rows else None
        with nvtx_range(MOVE_TOKENS):
            inputs = move_tokens(current.local, plan, current.gathered, self.domain, seq_multiple=self.seq_multiple,
                                 slot_rows=rows)
            if not current.gathered.images:
                return inputs
            vision = move_images(current.local, plan, current.gathered, self.domain,
                                 placement=plan.encoder_placement, seq_multiple=self.seq_multiple, slot_rows=rows)
        return replace(inputs, vision=vision)

    def _plan(self, batch: Batch) -> Plan:
        """The plan of `batch`, solved on rank `PLANNING_RANK` and broadcast to every rank. Collective."""
        with nvtx_range(PLAN_WAIT):
            return broadcast_plan(lambda: self.planning.plan(batch), self.domain)

    def _read(self) -> _Pending | None:
        local = self.source()
        return None if local is None else self._gather(local)

    def _gather(self, local: list[TokenSample]) -> _Pending:
        """The length gather, carrying this rank's report of its last timed step; every rank observes all
        reports. Collective."""
        report: tuple[float, ...] = ()
        timed = self.timer.take() if self.timer is not None and self.feedback is not None else None
        if timed is not None:
            plan, slots, span = timed
            report = self.feedback.report(plan, self.domain.position, slots, span)
        gathered = gather_batch(local, self.domain, report, width=self.feedback.width if self.feedback is not None else 0)
        if self.feedback is not None:
            self.feedback.observe(gathered.reports)
        return _Pending(local, gathered)


def check_shares(plan: Plan, policy: CommPolicy | None) -> None:
    """Refuse a plan with uneven shards where the job's attention cannot run them, before any token moves (the
    plan is the same on every rank, so every rank stops here): TransformerEngine's THD context parallelism
    (`layer_spec: te`) finds each rank's shard as the even zigzag (padded / d of every sample)."""
    uneven = next((g for g in plan.groups if g.shares), None)
    if uneven is not None and policy is not None and policy.layer_spec == "te":
        raise DhpError(f"the plan gives the group of ranks {list(uneven.ranks)} uneven shares {list(uneven.shares)}, "
                       "which TransformerEngine's attention (layer_spec te) cannot run: its THD context parallelism "
                       "knows only even zigzag shards; set uneven_shards: false in the cost config, or use "
                       "layer_spec local")


def check_chunks(plan: Plan, model: torch.nn.Module | list[torch.nn.Module]) -> None:
    """Refuse a plan whose interleaving is not the model's: its slot count and order follow V and P."""
    chunks = len(model) if isinstance(model, list) else 1
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if plan.virtual_stages != chunks or (chunks > 1 and plan.pipeline_stages != stages):
        raise DhpError(f"the plan interleaves {plan.virtual_stages} chunks per stage at {plan.pipeline_stages} stages, "
                       f"the model runs {chunks} at {stages}; plan with virtual_stages={chunks}"
                       + (f" and pipeline_stages={stages}" if chunks > 1 else ""))

