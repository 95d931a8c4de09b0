"""The forward-backward schedule of one planned step, with Megatron's schedule signature.

Megatron's `forward_backward_no_pipelining` runs a fixed number of microbatches; a planned step runs as
many as the plan gives this rank (one idle slot, for a rank the plan leaves idle), puts a domain barrier
between phases when the plan asks for one, and must then reduce gradients only after the last barrier.
The step engine's walk (`runtime/engine.py`) does that; this function hands it Megatron's own
per-microbatch `forward_step` / `backward_step`, so loss functions, gradient scaling, timers and
`finalize_model_grads` behave as upstream.

Under pipeline parallelism the engine runs the step's slots through megatron-core's own 1F1B with the
script's `forward_step` (`StepEngine.run`), which finalizes the gradients itself; with virtual pipelining
Megatron hands over its model chunks and one data iterator per chunk, all the same planned-step iterator
(`data.wrap_data_iterator`), and the interleaved schedule runs the chunks.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config, get_model_type

from megatron_dhp.errors import DhpError
from megatron_dhp.megatron.data import step_iterator
from megatron_dhp.runtime.engine import OverlappedReduction, Slot

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
    p2p_communicator=None,  # unused: under PP the plan sizes every receive (`runtime.pipeline.PlannedShapes`)
    pg_collection=None,
    force_all_reduce: bool | None = False,
) -> list:
    """Run this rank's microbatches of the next planned step; returns the loss reports, like Megatron's.

    `num_microbatches` is what Megatron would run per rank: the loader microbatches that make the step's
    global batch. How many microbatches this rank runs is the plan's business.
    """
    chunks = model if isinstance(model, list) else [model]
    data_iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator  # one per chunk, all one
    model = chunks[0] if len(chunks) == 1 else chunks
    if adjust_tensor_shapes_fn is not None:
        raise DhpError("adjust_tensor_shapes_fn (ModelOpt distillation) is not supported with --dhp")
    steps = step_iterator(data_iterator)
    steps.expect(num_microbatches)
    inputs = next(data_iterator)  # a replayed step reuses its groups: the engine prepared them when it dispatched
    config = get_model_config(chunks[0])
    work = _MegatronWork(forward_step_func, model, config, collect_non_loss_data, first_val_step, forward_only,
                         pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if len(chunks) > 1 and not steps.engine.pipelined:
        raise DhpError(f"{len(chunks)} model chunks without pipeline parallelism: virtual pipelining needs "
                       "--pipeline-model-parallel-size 2 or more")
    overlap = None
    if config.no_sync_func is not None and not forward_only and len(chunks) == 1:
        overlap = OverlappedReduction(no_sync=config.no_sync_func, start=model.start_grad_sync)
    # the walk then `work.finish` (megatron's finalize_model_grads), or megatron-core's 1F1B, which finalizes
    # the step itself and returns its loss reports
    reports = steps.engine.run(inputs, work, overlap=overlap)
    return reports if steps.engine.pipelined else work.store


class _MegatronWork:
    """Each slot through megatron-core's own `forward_step` and `backward_step`: the script's loss function,
    gradient scaling and timers behave as upstream, and the loss stays a per-token sum whose division by the
    token count `finalize_model_grads` does (the engine's normalisation rule). Under PP 1F1B calls the script's
    `forward_step` itself (`forward_step`, `schedule_options`)."""

    def __init__(self, forward_step_func, model, config, collect_non_loss_data: bool, first_val_step: bool | None,
                 forward_only: bool, *, pg_collection: object = None, force_all_reduce: bool | None = False) -> None:
        self.forward_step = forward_step_func
        self.model = model
        self.config = config
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.forward_only = forward_only
        self.schedule_options = {"forward_only": forward_only, "collect_non_loss_data": collect_non_loss_data,
                                 "first_val_step": first_val_step, "pg_collection": pg_collection,
                                 "force_all_reduce": force_all_reduce}
        self.store: list = []
        """The loss reports, Megatron's `forward_data_store`."""
        self.total_tokens = torch.zeros([], dtype=torch.int, device=_device())

    def forward(self, slot: Slot) -> torch.Tensor:
        if slot.index == 0 and self.config.timers is not None:  # the walk's; 1F1B times itself
            self.config.timers("forward-backward", log_level=1).start(barrier=self.config.barrier_with_L1_time)
        output, num_tokens = schedules.forward_step(
            self.forward_step,
            iter([slot]),
            self.model,
            slot.count,
            None,
            self.store,
            self.config,
            1,  # static CP size: per-token losses need no CP rescaling
            self.collect_non_loss_data,
            is_first_microbatch=schedules.check_first_val_step(self.first_val_step, self.forward_only, slot.index == 0),
            current_microbatch=slot.index,
        )
        self.total_tokens = self.total_tokens + num_tokens
        return output

    def backward(self, output: torch.Tensor) -> None:
        if self.forward_only:
            return
        if _BACKWARD_TAKES_MODEL_TYPE:
            schedules.backward_step(None, output, None, get_model_type(self.model), self.config)
        else:
            schedules.backward_step(None, output, None, self.config)

    def finish(self) -> None:
        """megatron's `finalize_model_grads` with the step's loss tokens, as its schedules call it after the last
        backward (not in evaluation)."""
        config = self.config
        if config.finalize_model_grads_func is not None and not self.forward_only:
            config.finalize_model_grads_func([self.model], self.total_tokens if config.calculate_per_token_loss else None,
                                             pg_collection=self.schedule_options["pg_collection"],
                                             force_all_reduce=self.schedule_options["force_all_reduce"])
        if config.timers is not None:
            config.timers("forward-backward").stop()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
