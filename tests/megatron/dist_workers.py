"""What every spawned rank of `test_hooks_distributed.py` runs: the Megatron-LM hooks on a megatron-core GPT.

A rank plays one Megatron-LM process: Megatron's loader (a `RerunDataIterator` over microbatch dicts, on
tensor-parallel rank 0 only), a megatron `DistributedDataParallel` model with `finalize_model_grads`, and
the three hooks a patched pretrain() uses: `setup` (domain, pool, planner, wrapped iterators),
`dhp_forward_backward` (the schedule) and `forward_step`. Every step is checked against the single-process
oracle on the same documents: loss and every gradient. The first run also logs as Megatron-LM does: the last rank
holds a TensorBoard writer, rank 0 prints the plan line, and each step's NVTX ranges are counted.
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_dhp.models.gpt import TinyGPTConfig, build_tiny_gpt, global_names
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.step_data import TokenSample
from megatron_dhp.verify.reference import build_reference_gpt, reference_step, single_rank_groups
from megatron_dhp.verify.selfcheck import full_grad
from megatron_dhp.workload.sample import Batch
from tests.numerics import RELATIVE, largest_abs, relative
from tests.ranks import start_cpu_rank

SEQ_LENGTH = 24
MICRO_BATCH = 2
LOADER_MICROBATCHES = 2
"""K: loader microbatches per rank and step (Megatron's get_num_microbatches())."""

DENSE = TinyGPTConfig()
VALIDATION_SETS = (100, 200)
"""The oracle's first step of each validation set's loader (`Harness.valid_sets`)."""
LOGGING = {"iteration": 9, "log_interval": 3, "tensorboard_log_interval": 2}
"""Megatron's iteration at set-up (as resumed from a checkpoint of iteration 9) and its two intervals, in the
first run: its three steps are iterations 10, 11 and 12."""


def megatron_args(**overrides: object) -> argparse.Namespace:
    """The parsed Megatron-LM arguments `setup` reads, with DHP on and small sizes."""
    args = argparse.Namespace(
        dhp=True, dhp_config=None, dhp_planner=None, dhp_max_tokens_per_rank=8, dhp_comm=None, dhp_cost=None,
        dhp_log_plans=None, dhp_max_groups_per_rank=None, seq_length=SEQ_LENGTH, distributed_timeout_minutes=1, reset_attention_mask=True,
        tensor_model_parallel_size=1, sequence_parallel=False,
        # the model's sizes, as validate_args leaves them (what a token keeps on a rank, `model_flags.model_shape`)
        hidden_size=DENSE.hidden_size, ffn_hidden_size=DENSE.ffn_hidden_size, num_layers=DENSE.num_layers,
        num_attention_heads=DENSE.num_attention_heads, group_query_attention=True,
        num_query_groups=DENSE.num_query_groups, kv_channels=DENSE.hidden_size // DENSE.num_attention_heads,
        bf16=False, fp16=False, recompute_granularity=None,
        # Megatron's logging (`hooks._log_steps`)
        iteration=0, log_interval=1, tensorboard_log_interval=1,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def loader_microbatches(step: int, position: int, *, count: int = LOADER_MICROBATCHES, seed: int = 0) -> list[dict]:
    """What Megatron's loader yields to data-parallel rank `position` at `step`: rows of documents.

    Positions restart at every document, as with --reset-position-ids; loss masks have zeros.
    """
    out = []
    for k in range(count):
        gen = torch.Generator().manual_seed(hash((seed, step, position, k)) % (1 << 31))
        tokens = torch.randint(0, TinyGPTConfig().vocab_size, (MICRO_BATCH, SEQ_LENGTH + 1), generator=gen)
        position_ids = torch.empty(MICRO_BATCH, SEQ_LENGTH, dtype=torch.int64)
        for row in range(MICRO_BATCH):
            cuts = sorted(torch.randperm(SEQ_LENGTH - 1, generator=gen)[: int(torch.randint(0, 4, (1,), generator=gen))] + 1)
            starts = [0, *[int(c) for c in cuts]]
            for a, b in zip(starts, [*starts[1:], SEQ_LENGTH]):
                position_ids[row, a:b] = torch.arange(b - a)
        loss_mask = (torch.rand(MICRO_BATCH, SEQ_LENGTH, generator=gen) > 0.2).float()
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
                    "position_ids": position_ids, "attention_mask": None})
    return out


def documents_of_step(step: int, num_positions: int, **kw: object) -> list[TokenSample]:
    """Every document of the step's global batch, for the oracle (ids do not matter to it)."""
    from megatron_dhp.megatron.data import sequences

    docs = [s for p in range(num_positions) for b in loader_microbatches(step, p, **kw)
            for s in sequences(b, split_documents=True)]
    return [TokenSample(i, t, lab, m) for i, (t, lab, m) in enumerate(docs)]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model: object = None) -> tuple:
    """pretrain_gpt.py's loss function: the per-token (sum, count, report) form."""
    losses = output_tensor.view(-1).float()
    loss = torch.sum(losses * loss_mask.view(-1).float())
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


class Harness:
    """One rank's Megatron-LM process: model, loader, and the DHP hooks around them."""

    def __init__(self, *, seed: int, overlap_grad_reduce: bool = False, steps: range = range(6),
                 gpt: TinyGPTConfig = DENSE) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.rerun_state_machine import RerunDataIterator

        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.position = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        self.num_positions = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        inner = build_tiny_gpt(gpt, seed=seed)
        self.model = DistributedDataParallel(
            config=inner.config,
            ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce, bucket_size=2000),
            module=inner,
        )
        config = inner.config
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync if overlap_grad_reduce else None
        self.reference = build_reference_gpt(replace(gpt, sequence_parallel=False), single_rank_groups(), seed=seed)
        self.pulled = 0
        # Megatron builds loaders on tensor-parallel rank 0 of the first and the last pipeline stage
        ends = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
        if parallel_state.get_tensor_model_parallel_rank() == 0 and ends:
            self.train = RerunDataIterator(self._loader(steps))
            self.valid = RerunDataIterator(self._loader(range(100, 102)))
            # --multiple-validation-sets: one loader per set, as Megatron-LM's pretrain() builds them
            self.valid_sets = [RerunDataIterator(self._loader(range(first, first + 2))) for first in VALIDATION_SETS]
        else:
            self.train = self.valid = self.valid_sets = None

    def _loader(self, steps: range):
        for step in steps:
            for mb in loader_microbatches(step, self.position):
                self.pulled += 1
                yield mb

    def run(self, data_iterator: object, *, forward_only: bool = False) -> tuple[list, float]:
        """One step through the DHP schedule, like train_step: (reports, loss over the global batch)."""
        from megatron_dhp.megatron import dhp_forward_backward, forward_step

        if not forward_only:
            self.model.zero_grad_buffer()
        reports = dhp_forward_backward(
            forward_step_func=partial(forward_step, loss_func=loss_func),
            data_iterator=data_iterator,
            model=[self.model],
            num_microbatches=LOADER_MICROBATCHES,
            seq_length=SEQ_LENGTH,
            micro_batch_size=MICRO_BATCH,
            forward_only=forward_only,
        )
        # under PP only the last stage reports losses
        total = torch.stack([r["lm loss"] for r in reports]).sum(0).double() if reports else torch.zeros(2).double()
        dist.all_reduce(total, group=data_iterator.iterable.runtime.steps.domain.group)
        dist.all_reduce(total, group=self.pp_group)
        return reports, float(total[0] / total[1])

    def compare(self, step: int, loss: float, *, grads: bool = True) -> dict:
        """Max |difference| of loss and of every gradient against the oracle on the step's documents, relative
        to the oracle's loss and its largest gradient element."""
        ref = reference_step(self.reference, documents_of_step(step, self.num_positions))
        worst = 0.0
        if grads:
            names = global_names(self.model)
            for name, param in self.model.module.named_parameters():
                worst = max(worst, float((full_grad(param, self.tp_group) - ref.grads[names[name]]).abs().max()))
        diffs = torch.tensor([abs(loss - ref.loss), worst], dtype=torch.float64)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        return {"loss": loss, "ref": ref.loss, "dloss": relative(float(diffs[0]), ref.loss),
                "dgrad": relative(float(diffs[1]), largest_abs(ref.grads.values()))}

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.main_grad.clone() for n, p in self.model.module.named_parameters()}


class PlanLines(logging.Handler):
    """Counts the `dhp plan:` lines the step iterators print while attached."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.target = logging.getLogger("megatron_dhp.megatron.data")
        self.level_before = self.target.level

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("dhp plan:")

    def attach(self) -> None:
        self.target.addHandler(self)
        self.target.setLevel(logging.INFO)

    def detach(self) -> None:
        self.target.removeHandler(self)
        self.target.setLevel(self.level_before)


@contextmanager
def nvtx_ranges() -> Iterator[list[str]]:
    """The NVTX ranges pushed inside the block as if CUDA were available, in order ("pop" for each pop)."""
    from unittest import mock

    from megatron_dhp.runtime import nvtx

    calls: list[str] = []
    with (mock.patch.object(nvtx, "enabled", lambda: True),
          mock.patch.object(torch.cuda.nvtx, "range_push", calls.append),
          mock.patch.object(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))):
        yield calls


def plan_facts(plan: Plan) -> dict:
    """What the TensorBoard check compares with the scalars the last rank wrote for this plan."""
    return {"microbatches": plan.num_microbatches, "sizes": dict(Counter(g.size for g in plan.groups)),
            "predicted": plan.predicted_step_time_s, "lower_bound": plan.lower_bound_s, "solve_ms": plan.solve_time_ms}


class HandPlanner:
    """A stand-in for `JobPlanner` returning plans no planner here produces: `makers[k](batch)` at step k."""

    loop = SimpleNamespace(adaptive=False)
    """A closed loop that is off: the hand-made plans ignore the timings."""

    def __init__(self, *makers) -> None:
        self.makers = list(makers)

    def plan(self, batch: Batch) -> Plan:
        return self.makers.pop(0)(batch)

    def prefetch(self, batch: Batch) -> None:
        pass

    def close(self) -> None:
        pass


def barrier_plan(batch: Batch, n: int) -> Plan:
    """Phase 0: every rank alone on a few samples; phase 1: ranks 0..n-2 on the rest, rank n-1 idle; barriers.

    Rank n-1's last microbatch is followed by a barrier, so its gradient reduction must start after it.
    """
    ids = [s.id for s in batch.samples]
    first, rest = ids[: 2 * n], ids[2 * n:]
    groups = [PlanGroup((r,), tuple((i,) for i in first[r::n])) for r in range(n)]
    groups.append(PlanGroup(tuple(range(n - 1)), tuple(tuple(rest[i::2]) for i in range(2) if rest[i::2]), phase=1))
    groups.append(PlanGroup((n - 1,), (), phase=1))
    return Plan("hand", n, n, batch.samples, tuple(groups), phase_barrier=True)


def idle_plan(batch: Batch, n: int) -> Plan:
    """Rank n-1 gets nothing at all this step; the others share the batch in groups of one and n-1."""
    ids = [s.id for s in batch.samples]
    half = len(ids) // 2
    groups = [PlanGroup((r,), tuple((i,) for i in ids[r:half:n - 1])) for r in range(n - 1)]
    groups.append(PlanGroup(tuple(range(n - 1)), (tuple(ids[half:]),), phase=1))
    groups.append(PlanGroup((n - 1,), ()))
    return Plan("hand", n, n, batch.samples, tuple(groups))


def hooks_checks(tensorboard_dir: str) -> dict:
    """4 ranks: TP 1 (domain of 4), then TP 2 and PP 2 (two domains of 2 each) in the same processes; the first
    run's last rank writes its TensorBoard events to `tensorboard_dir`."""
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dhp.megatron import setup
    from megatron_dhp.megatron.data import wrap_data_iterator
    from megatron_dhp.megatron.metrics import Writers

    start_cpu_rank(timeout_s=90)
    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    out: dict = {"rank": dist.get_rank()}

    # --- planned steps with the dhp planner, planning one step ahead, against the oracle; logged as Megatron-LM
    # logs: Megatron's writers on the last rank only
    h = Harness(seed=3)
    writers = Writers()
    if dist.get_rank() == dist.get_world_size() - 1:
        from torch.utils.tensorboard import SummaryWriter

        writers = Writers(tensorboard=SummaryWriter(tensorboard_dir))
    lines = PlanLines()
    lines.attach()
    train, valid, _ = setup(megatron_args(**LOGGING), h.train, h.valid, None, writers=writers)
    runtime = train.iterable.runtime
    out["wrapped"] = (type(train).__name__, type(train.iterable).__name__, train.iterable.source is h.train.iterable)
    out["exact"], out["counts"], out["at_startup"] = [], [], runtime.steps.pool.at_startup
    out["plans"], out["lines"], out["ranges"] = [], [], []
    for step in range(3):
        with nvtx_ranges() as ranges:
            reports, loss = h.run(train)
        out["ranges"].append(ranges)
        out["plans"].append(plan_facts(train.saved_microbatches[-1].plan))  # the step's, kept for a rerun
        out["lines"].append(lines.count)
        out["exact"].append(h.compare(step, loss))
        out["counts"].append((len(reports), runtime.steps.pool.created))
        if step == 0:
            # Megatron's rerun state machine replays the step: same microbatches, no loader read, same gradients
            first, pulled = h.grads(), h.pulled
            train.rewind()
            h.run(train)
            out["replay"] = (max(float((g - first[n]).abs().max()) for n, g in h.grads().items()), h.pulled - pulled)
            train.advance()
    out["pulled_after_3"] = h.pulled  # 3 steps + the one read ahead, K loader microbatches each
    _, loss = h.run(valid, forward_only=True)
    out["eval"] = h.compare(100, loss, grads=False)
    out["lines"].append(lines.count)
    lines.detach()
    if writers.tensorboard is not None:
        writers.tensorboard.close()

    # --- hand plans with overlapped gradient reduction: a rank with no work, then barriers between phases.
    # The first step records DDP's per-bucket readiness; in the second, rank 3's last microbatch is followed
    # by barriers, so it runs under no_sync and its reduction must be started after them.
    runtime.steps.planner.close()
    n = runtime.steps.domain.size
    g = Harness(seed=4, overlap_grad_reduce=True, steps=range(3, 5))
    hand = replace(runtime, steps=replace(runtime.steps, planner=HandPlanner(partial(idle_plan, n=n), partial(barrier_plan, n=n))))
    it = wrap_data_iterator(g.train, hand, lookahead=False)
    for name, step in (("idle", 3), ("barrier", 4)):
        reports, loss = g.run(it)
        out[name] = (g.compare(step, loss), len(reports))

    # --- tensor parallel 2: TP rank 1 has no loader and receives its rank 0's sequences
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    t = Harness(seed=5)
    train, valid, _ = setup(megatron_args(dhp_comm="ring", dhp_max_tokens_per_rank=12, tensor_model_parallel_size=2,
                                          multiple_validation_sets=True), t.train, t.valid_sets, None)
    tp2 = train.iterable.runtime
    out["tp2_domain"] = tp2.steps.domain.global_ranks
    out["tp2"] = [t.compare(step, t.run(train)[1]) for step in range(2)]
    # each validation set on its own data, on the TP rank Megatron handed None too
    out["valid_sets"] = [t.compare(first, t.run(it, forward_only=True)[1], grads=False)
                         for it, first in zip(valid, VALIDATION_SETS, strict=True)]
    tp2.steps.planner.close()

    # --- TP 2 with --sequence-parallel: every shard padded to an even row count, LayerNorm grads over TP
    u = Harness(seed=7, gpt=TinyGPTConfig(sequence_parallel=True))
    train, _, _ = setup(megatron_args(dhp_max_tokens_per_rank=12, tensor_model_parallel_size=2, sequence_parallel=True),
                        u.train, None, None)
    sp = train.iterable.runtime
    out["sp"] = [u.compare(step, u.run(train)[1]) for step in range(2)]
    out["sp_multiple"] = train.iterable.engine.seq_multiple
    sp.steps.planner.close()

    # --- pipeline parallel 2: two stages of a domain of 2 through megatron-core's 1F1B; the last stage's
    # loader is not read, the first stage's TP rank 0 sends the sequences
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    q = Harness(seed=6)
    train, valid, _ = setup(megatron_args(dhp_max_tokens_per_rank=24), q.train, q.valid, None)
    pp2 = train.iterable.runtime
    out["pp2_domain"] = (pp2.steps.domain.global_ranks, train.iterable.source is not None)
    out["pp2"] = []
    for step in range(2):
        reports, loss = q.run(train)
        out["pp2"].append(q.compare(step, loss))
        out["pp2_counts"] = len(reports)
    out["pp2"].append(q.compare(100, q.run(valid, forward_only=True)[1], grads=False))
    pp2.steps.planner.close()

    # --- MoE with expert parallelism 2 carved from the domain of 4, under hand plans where rank 3 is idle
    # and the others run different slot counts: every rank runs the same slots, so the dispatcher's
    # collectives pair up; allgather gathers equal blocks, so its k-th slots also hold equal rows
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    out["ep2"], out["ep2_rules"] = [], {}
    for seed, steps, dispatcher in ((8, range(5, 7), "alltoall"), (9, range(7, 9), "allgather")):
        e = Harness(seed=seed, steps=steps, gpt=TinyGPTConfig(num_experts=4, moe_token_dispatcher=dispatcher))
        train, _, _ = setup(megatron_args(num_experts=4, expert_model_parallel_size=2, moe_token_dispatcher_type=dispatcher),
                            e.train, None, None)
        ep2 = train.iterable.runtime
        out["ep2_rules"][dispatcher] = (train.iterable.engine.aligned_slots, train.iterable.engine.equal_rows)
        ep2.steps.planner.close()
        hand = replace(ep2, steps=replace(ep2.steps, planner=HandPlanner(partial(idle_plan, n=4), partial(barrier_plan, n=4))))
        it = wrap_data_iterator(e.train, hand, lookahead=False)
        out["ep2"] += [e.compare(step, e.run(it)[1]) for step in steps]
    out["tolerance"] = RELATIVE
    return out
