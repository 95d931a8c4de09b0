"""Bridge's GPT `forward_step` for a planned microbatch: megatron-dhp's `forward_step` with Bridge's loss.

Bridge's own `gpt_step.forward_step` reads a loader batch from the iterator; under dhp the schedule hands it a
planned microbatch (a step-engine `Slot`) instead, which megatron-dhp's `forward_step` runs as THD over the
microbatch's dynamic group. The loss is Bridge's `masked_next_token_loss` (per-token sum, token count, report),
with the container's NaN and spike checks, so Bridge's loss reduction and logging stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from megatron_dhp.megatron.forward import forward_step as dhp_forward_step
from megatron_dhp.runtime.engine import Slot


def forward_step(state: Any, data_iterator: Iterator[Slot], model: torch.nn.Module,
                 return_schedule_plan: bool = False) -> tuple[torch.Tensor, Callable]:
    """The next planned microbatch through `model`; Bridge's (output, loss function). Pass it to `pretrain`
    where a Bridge script passes `gpt_step.forward_step` (Bridge injects `state` by the parameter's name)."""
    if return_schedule_plan:
        from megatron_dhp.errors import DhpError

        raise DhpError("return_schedule_plan (combined 1F1B overlap, model.overlap_moe_expert_parallel_comm) is not "
                       "supported with dhp; set model.overlap_moe_expert_parallel_comm = False")
    from megatron.bridge.training.losses import masked_next_token_loss

    checks = state.cfg.rerun_state_machine
    loss = partial(_bridge_loss, masked_next_token_loss, check_for_nan_in_loss=checks.check_for_nan_in_loss,
                   check_for_spiky_loss=checks.check_for_spiky_loss)
    return dhp_forward_step(data_iterator, model, loss)


def _bridge_loss(loss_func: Callable, loss_mask: torch.Tensor, output_tensor: torch.Tensor, *, model: object = None,
                 **checks: bool) -> tuple:
    """Bridge's loss in the form megatron-dhp's `forward_step` calls (`model=` given, which Bridge's takes not)."""
    return loss_func(loss_mask, output_tensor, **checks)
