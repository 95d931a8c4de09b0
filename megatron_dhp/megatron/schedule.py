"""The forward-backward schedule of one planned step, with Megatron's schedule signature.

Megatron's `forward_backward_no_pipelining` runs a fixed number of microbatches; a planned step runs as
many as the plan gives this rank (none, for a rank the plan leaves idle), puts a domain barrier between
phases when the plan asks for one, and must then reduce gradients only after the last barrier. This
function is that loop around Megatron's own per-microbatch `forward_step` / `backward_step`, so loss
functions, gradient scaling, timers and `finalize_model_grads` behave as upstream.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config, get_model_type

from megatron_dhp.errors import DhpError
from megatron_dhp.megatron.data import step_iterator
from megatron_dhp.megatron.forward import DhpMicrobatch
from megatron_dhp.runtime.dispatch import MicrobatchInputs, StepInputs
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.runtime.step import PHASE_BARRIER, execution_order, microbatch_context

# megatron-core 0.16 passes the model type to backward_step; 0.19 dropped the argument
_BACKWARD_TAKES_MODEL_TYPE = "model_type" in inspect.signature(schedules.backward_step).parameters


def dhp_forward_backward(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int | None = None,  # unused, as in forward_backward_no_pipelining
    micro_batch_size: int | None = None,  # unused
    decoder_seq_length: int | None = None,  # unused
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,  # unused: no pipelining
    pg_collection=None,
    force_all_reduce: bool | None = False,
) -> list:
    """Run this rank's microbatches of the next planned step; returns the loss reports, like Megatron's.

    `num_microbatches` is what Megatron would run per rank: the loader microbatches that make the step's
    global batch. How many microbatches this rank runs is the plan's business.
    """
    model, data_iterator = _only(model, "model"), _only(data_iterator, "data iterator")
    if adjust_tensor_shapes_fn is not None:
        raise DhpError("adjust_tensor_shapes_fn (ModelOpt distillation) is not supported with --dhp")
    steps = step_iterator(data_iterator)
    runtime = steps.runtime
    config = get_model_config(model)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    steps.expect(num_microbatches)
    inputs = next(data_iterator)
    runtime.pool.prepare(inputs.plan)  # world-collective; a replayed or cached plan creates nothing
    work = work_items(inputs, runtime.domain.position)
    count = sum(item is not PHASE_BARRIER for item in work)
    store: list = []
    total_tokens = torch.zeros([], dtype=torch.int, device=_device())
    index = 0

    def run(item: MicrobatchInputs | None) -> None:
        nonlocal total_tokens, index
        if item is PHASE_BARRIER:
            dist.barrier(group=runtime.domain.group)
            return
        ctx = microbatch_context(item, runtime.pool, comm=runtime.config.comm, backend=runtime.config.attention_backend)
        output, num_tokens = schedules.forward_step(
            forward_step_func,
            iter([DhpMicrobatch(item, ctx)]),
            model,
            count,
            None,
            store,
            config,
            1,  # static CP size: per-token losses need no CP rescaling
            collect_non_loss_data,
            is_first_microbatch=schedules.check_first_val_step(first_val_step, forward_only, index == 0),
            current_microbatch=index,
        )
        total_tokens = total_tokens + num_tokens
        index += 1
        if not forward_only:
            _backward(output, config, model)

    barriers = inputs.plan.phase_barrier
    with (config.no_sync_func or contextlib.nullcontext)():
        for item in work if barriers else work[:-1]:
            run(item)
    if not barriers:
        run(work[-1])  # outside no_sync: the last backward starts the gradient reduction while it runs
    elif config.no_sync_func is not None and not forward_only:
        # A reduction must not start before a barrier on the same ranks, and every rank must issue the
        # buckets in one order: all ranks start it here, after their last barrier, in bucket order.
        model.start_grad_sync()

    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            [model],
            total_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return store


def work_items(inputs: StepInputs, position: int) -> list[MicrobatchInputs | None]:
    """This rank's microbatches in execution order, with a `PHASE_BARRIER` between phases if the plan has them.

    A rank the plan leaves idle runs one one-token microbatch with no loss instead, so that every rank
    reports a loss entry and runs the same per-step code as the others (it adds nothing to the gradients).
    """
    return execution_order(inputs.plan, list(inputs.microbatches) or [_idle_microbatch(position)])


def _idle_microbatch(position: int) -> MicrobatchInputs:
    zero = torch.zeros(1, dtype=torch.int64)
    return MicrobatchInputs(
        group_ranks=(position,),
        phase=0,
        layout=MicrobatchLayout(sample_ids=(-1,), lengths=(1,), group_size=1, rank=0),
        input_ids=zero,
        labels=zero,
        loss_mask=torch.zeros(1),
        position_ids=zero,
    )


def _backward(output: torch.Tensor, config, model: torch.nn.Module) -> None:
    if _BACKWARD_TAKES_MODEL_TYPE:
        schedules.backward_step(None, output, None, get_model_type(model), config)
    else:
        schedules.backward_step(None, output, None, config)


def _only(value, what: str):
    if isinstance(value, list):
        if len(value) != 1:
            raise DhpError(f"the megatron-dhp schedule runs one model chunk, got {len(value)} {what}s; "
                           "virtual pipelining is not supported")
        return value[0]
    return value


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
