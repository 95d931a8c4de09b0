"""One step under pipeline parallelism (PP = P > 1): megatron-core's own 1F1B over the slots, interleaved
when each stage holds V > 1 model chunks (virtual pipelining).

Every (TP, PP) coordinate's domain applies the same plan, so a dynamic group is one pipeline: the rank at
domain position r of stage s sends its activations to position r of stage s + 1 (megatron's pipeline group
of a rank joins the same domain position of every stage; checked once). Each position runs
`forward_backward_pipelining_without_interleaving`, unchanged, over its slot list (`slots.pipeline_work`),
with `num_microbatches` its own slot count; slot alignment makes it deadlock-free (`plan.pipeline`).
Interleaved, each position runs `forward_backward_pipelining_with_interleaving`, unchanged, over the same
number of slots on every position (a multiple of P, `plan.pipeline.padded_slot_count`): the schedule's
order is then one list of (slot, chunk, F/B) on every position, so every member of a group meets each of its
collectives at the same place in it, and every chunk reads the slots from its own iterator in slot order.

- Tokens: every stage moves the same tokens (the engine's step); the first stage reads the input ids, the
  last the labels and loss mask, every stage the layout, `PackedSeqParams` (RoPE) and dynamic group.
- Shapes: a THD microbatch's activation has as many rows as the slot's local tokens, which every stage
  knows from the plan, so `PlannedShapes` receives each slot with its own row count (no shape exchange,
  no silent mismatch of a fixed `seq_length` buffer): megatron-core asks its `_communicate_shapes` for
  every receive when shapes vary, and the plan answers in the order the schedule receives.
- Loss: the last stage's loss function returns the slot's masked loss sum and its loss-token count;
  megatron-core's `finalize_model_grads` broadcasts the count from the last stage, sums it over the
  domain and divides the gradients once: the mean over every loss token of the global batch.
- Tied embeddings: `finalize_model_grads` all-reduces the embedding gradient between stage 0 and stage
  P - 1 of the same position (megatron's embedding group).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.pipeline import chunk_table
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.layer_spec import seq_multiple

if TYPE_CHECKING:  # the engine runs `run_1f1b`; a slot is its data
    from megatron_dhp.runtime.engine import Slot


class PlannedShapes(P2PCommunicator):
    """megatron-core's p2p communicator, receiving each slot's activation with the row count the plan gives.

    The schedule receives forward activations in the order the previous stage sends them and gradients in
    the order the next stage sends them; both follow the schedule table (`plan.pipeline.chunk_table`, each
    slot once at V = 1), except across the ring's wrap (interleaved only): stage 0 gets no activation of
    the last chunk and stage P - 1 no gradient of it. Two cursors over those row counts name every shape,
    answered where megatron asks for shapes that vary (`_communicate_shapes`, no exchange)."""

    def __init__(self, pp_group: dist.ProcessGroup, config: object, rows: list[int], virtual: int = 1) -> None:
        super().__init__(pp_group, config)
        self.config = copy.copy(config)
        self.config.variable_seq_lengths = True  # megatron-core then asks `_communicate_shapes` for each receive
        self._hidden = config.hidden_size
        # under sequence parallelism a stage's activation holds this TP rank's 1 / T of the rows
        split = seq_multiple(config)
        stage, stages = pp_group.rank(), pp_group.size()
        table = [(j, 0) for j in range(len(rows))] if virtual == 1 else chunk_table(len(rows), stages, virtual)
        sent = [c != virtual - 1 for _, c in table]  # what crosses the wrap: every chunk but the last
        self._forward: Iterator[int] = iter(rows[j] // split for (j, _), s in zip(table, sent) if stage > 0 or s)
        self._backward: Iterator[int] = iter(rows[j] // split for (j, _), s in zip(table, sent)
                                             if stage < stages - 1 or s)

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev: bool, recv_next: bool):
        return ([next(self._forward), 1, self._hidden] if recv_prev else [0, 0, 0],
                [next(self._backward), 1, self._hidden] if recv_next else [0, 0, 0])


def check_pipeline(domain: DynamicDomain) -> None:
    """Check that megatron's pipeline group of this rank joins the same domain position on every stage.
    Collective over the pipeline group."""
    group = parallel_state.get_pipeline_model_parallel_group()
    positions = [0] * group.size()
    dist.all_gather_object(positions, domain.position, group=group)
    if len(set(positions)) != 1:
        raise DhpError(f"the pipeline of rank {domain.rank} joins domain positions {positions}; they must be one")


def run_1f1b(forward_step_func: Callable, slots: list[Slot], model: torch.nn.Module | list[torch.nn.Module], *,
             forward_only: bool = False, collect_non_loss_data: bool = False, first_val_step: bool | None = None,
             pg_collection: ProcessGroupCollection | None = None, force_all_reduce: bool | None = False) -> list:
    """megatron-core's 1F1B, unchanged, over `slots`: `forward_step_func(iterator, model)` takes the next `Slot`
    from the iterator it is given; a list of V > 1 model chunks runs the interleaved schedule, each chunk
    with its own iterator over the slots. Returns megatron's loss reports (last stage). Gradients are
    finalized by `model.config.finalize_model_grads_func`, as megatron's schedule always does."""
    chunks = model if isinstance(model, list) else [model]
    config = get_model_config(chunks[0])
    virtual = len(chunks)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if virtual > 1 and config.microbatch_group_size_per_vp_stage != pp_group.size():
        raise DhpError(f"microbatch_group_size_per_vp_stage {config.microbatch_group_size_per_vp_stage} is not "
                       "the pipeline size: dynamic groups plan megatron-core's default group of P microbatches; unset it")
    if virtual > 1 and pp_group.size() == 2 and config.batch_p2p_comm:
        raise DhpError("interleaved pipelining at 2 stages with batch_p2p_comm: megatron-core's batched p2p posts both "
                       "directions to the one neighbour in an order that crosses them when their shapes differ; use "
                       "overlap_p2p_comm (Megatron-LM's default with virtual pipelining)")
    schedule = forward_backward_pipelining_with_interleaving if virtual > 1 else forward_backward_pipelining_without_interleaving
    return schedule(
        forward_step_func=forward_step_func,
        data_iterator=[iter(slots) for _ in chunks] if virtual > 1 else iter(slots),
        model=chunks if virtual > 1 else chunks[0],
        num_microbatches=len(slots),
        seq_length=1,  # unused: `PlannedShapes` gives every receive its slot's row count
        micro_batch_size=1,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        p2p_communicator=PlannedShapes(pp_group, config, [slot.inputs.layout.num_slots for slot in slots], virtual),
        pg_collection=pg_collection or ProcessGroupCollection.use_mpu_process_groups(),
        force_all_reduce=force_all_reduce,
    )
