"""`forward_step` of a planned microbatch: the model runs it as THD over the microbatch's dynamic group.

The schedule hands Megatron's `forward_step` an iterator over one step-engine `Slot`; the training script's
`forward_step` passes it here (one line in pretrain_gpt.py) together with its own loss function, so the
script's loss, NaN checks and reports stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.engine import Slot
from megatron_dhp.runtime.step import forward_thd


def forward_step(
    data_iterator: Iterator[Slot], model: torch.nn.Module, loss_func: Callable
) -> tuple[torch.Tensor, Callable]:
    """Run the next planned microbatch; returns Megatron's (output, loss function of this microbatch).

    `loss_func(loss_mask, output_tensor, model=...)` is the training script's, as in pretrain_gpt.py. Its
    `DhpPackedSeqParams` carry the dynamic group to RoPE, TransformerEngine and megatron-dhp's attention.
    """
    mb = next(data_iterator)
    output = forward_thd(model, mb.inputs, mb.context)
    return output, _per_token(partial(loss_func, mb.inputs.loss_mask.to(output.device), model=model))


def _per_token(loss_func: Callable) -> Callable:
    """`loss_func`, refusing the 2-tuple form, whose mean loss would be scaled wrongly under dynamic groups."""

    def checked(output_tensor: torch.Tensor, **kwargs: object) -> tuple:
        out = loss_func(output_tensor, **kwargs)
        if not kwargs and len(out) != 3:
            raise DhpError(
                f"the loss function returned {len(out)} values; --dhp needs the per-token form "
                "(loss_sum, num_tokens, report) that pretrain_gpt.py's loss_func returns"
            )
        return out

    return checked
