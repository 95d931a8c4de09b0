"""Megatron-Bridge integration: megatron-dhp in a Bridge `pretrain(config, forward_step)` run.

What a Bridge user writes (docs/bridge.md)::

    from megatron_dhp.bridge import DhpConfig, forward_step, pretrain, with_dhp

    config = with_dhp(my_recipe(), DhpConfig(max_tokens_per_rank=4096))
    pretrain(config, forward_step)

- `with_dhp` (config.py): the `dhp` section of the `ConfigContainer`.
- `bridge_args` (args.py): the one adapter from a `ConfigContainer` to what megatron-dhp's Megatron-LM hooks read;
  `validate` refuses, as one `DhpError`, what cannot work under Bridge (refusals.py adds Bridge's own settings to
  the Megatron-LM table).
- `pretrain` (seams.py): Bridge's `pretrain` with the hooks at Bridge's seams: the layer spec of the model
  provider, the data iterators of `setup`, `get_forward_backward_func` of train and eval.
- `forward_step` (forward.py): Bridge's GPT loss on one planned microbatch.

Importing the package needs megatron-core; megatron-bridge is imported when `pretrain` or `forward_step` runs.
"""

from megatron_dhp.bridge.args import bridge_args, validate
from megatron_dhp.bridge.config import DhpConfig, dhp_of, with_dhp
from megatron_dhp.bridge.forward import forward_step
from megatron_dhp.bridge.seams import pretrain

__all__ = ["DhpConfig", "bridge_args", "dhp_of", "forward_step", "pretrain", "validate", "with_dhp"]
