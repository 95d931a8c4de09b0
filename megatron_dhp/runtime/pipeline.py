"""One step under pipeline parallelism (PP = P > 1): megatron-core's own non-interleaved 1F1B over the slots.

Every (TP, PP) coordinate's domain applies the same plan, so a dynamic group is one pipeline: the rank at
domain position r of stage s sends its activations to position r of stage s + 1 (megatron's pipeline group
of a rank joins the same domain position of every stage; checked once). Each position runs
`forward_backward_pipelining_without_interleaving`, unchanged, over its slot list (`slots.pipeline_work`),
with `num_microbatches` its own slot count; slot alignment makes it deadlock-free (`plan.pipeline`).

- Tokens: every stage moves the same tokens (the engine's step); the first stage reads the input ids, the
  last the labels and loss mask, every stage the layout, `PackedSeqParams` (RoPE) and dynamic group.
- Shapes: a THD microbatch's activation has as many rows as the slot's local tokens, which every stage
  knows from the plan, so `PlannedShapes` receives each slot with its own row count (no shape exchange,
  no silent mismatch of a fixed `seq_length` buffer).
- Loss: the last stage's loss function returns the slot's masked loss sum and its loss-token count;
  megatron-core's `finalize_model_grads` broadcasts the count from the last stage, sums it over the
  domain and divides the gradients once: the mean over every loss token of the global batch.
- Tied embeddings: `finalize_model_grads` all-reduces the embedding gradient between stage 0 and stage
  P - 1 of the same position (megatron's embedding group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.layer_spec import seq_multiple

if TYPE_CHECKING:  # the engine runs `run_1f1b`; a slot is its data
    from megatron_dhp.runtime.engine import Slot


class PlannedShapes(P2PCommunicator):
    """megatron-core's p2p communicator, receiving each slot's activation with the row count the plan gives.

    The 1F1B schedule receives forward activations in slot order and output gradients in slot order, so two
    cursors over the slots' row counts name every buffer's shape."""

    def __init__(self, pp_group: dist.ProcessGroup, config: object, rows: list[int]) -> None:
        super().__init__(pp_group, config)
        self._hidden = config.hidden_size
        # under sequence parallelism a stage's activation holds this TP rank's 1 / T of the rows
        split = seq_multiple(config)
        self._forward: Iterator[int] = iter(r // split for r in rows)
        self._backward: Iterator[int] = iter(r // split for r in rows)

    def _communicate(self, *, recv_prev: bool, recv_next: bool, tensor_shape: object, **kwargs: object):
        if recv_prev and recv_next:
            raise DhpError("a receive from both neighbours happens only in interleaved pipelining, which is not supported")
        if recv_prev:
            tensor_shape = (next(self._forward), 1, self._hidden)
        elif recv_next:
            tensor_shape = (next(self._backward), 1, self._hidden)
        return super()._communicate(recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape, **kwargs)


def check_pipeline(domain: DynamicDomain) -> None:
    """Refuse what the pipeline runner cannot do exactly, and check that megatron's pipeline group of this
    rank joins the same domain position on every stage. Collective over the pipeline group."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and vpp > 1:
        raise DhpError(
            f"interleaved (virtual) pipelining (virtual size {vpp}) is not supported with dynamic groups: its "
            "schedule needs per-chunk slot alignment and exact p2p matching that are not implemented; use 1"
        )
    group = parallel_state.get_pipeline_model_parallel_group()
    positions = [0] * group.size()
    dist.all_gather_object(positions, domain.position, group=group)
    if len(set(positions)) != 1:
        raise DhpError(f"the pipeline of rank {domain.rank} joins domain positions {positions}; they must be one")


def run_1f1b(forward_step_func: Callable, slots: list[Slot], model: torch.nn.Module, *, forward_only: bool = False,
             collect_non_loss_data: bool = False, first_val_step: bool | None = None,
             pg_collection: ProcessGroupCollection | None = None, force_all_reduce: bool | None = False) -> list:
    """megatron-core's non-interleaved 1F1B, unchanged, over `slots`: `forward_step_func(iterator, model)` takes
    the next `Slot` from the iterator it is given. Returns megatron's loss reports (last stage). Gradients are
    finalized by `model.config.finalize_model_grads_func`, as megatron's schedule always does."""
    config = get_model_config(model)
    return forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step_func,
        data_iterator=iter(slots),
        model=model,
        num_microbatches=len(slots),
        seq_length=1,  # unused: `PlannedShapes` gives every receive its slot's row count
        micro_batch_size=1,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        p2p_communicator=PlannedShapes(parallel_state.get_pipeline_model_parallel_group(), config,
                                       [slot.inputs.layout.num_slots for slot in slots]),
        pg_collection=pg_collection or ProcessGroupCollection.use_mpu_process_groups(),
        force_all_reduce=force_all_reduce,
    )
