"""Megatron-Bridge integration: megatron-dhp in a Bridge `pretrain(config, forward_step)` run.

What a Bridge user writes (docs/bridge.md)::

    from megatron_dhp.bridge import DhpConfig, forward_step, pretrain, with_dhp

    config = with_dhp(my_recipe(), DhpConfig(max_tokens_per_rank=4096))
    pretrain(config, forward_step)

- `with_dhp` (config.py): the recipe as a `DhpConfigContainer` (container.py), Bridge's `ConfigContainer` with a `dhp`
  field that Bridge's overrides, recipe YAML and saved run config handle like its own sections; `dhp_of` reads it
  as a `DhpConfig`.
- `bridge_args` (args.py): the one adapter from a `ConfigContainer` to what megatron-dhp's Megatron-LM hooks read;
  `validate` refuses, as one `DhpError`, what cannot work under Bridge (refusals.py adds Bridge's own settings to
  the Megatron-LM table).
- `pretrain` (seams.py): Bridge's `pretrain` with the hooks at Bridge's seams: the layer spec of the model
  provider, the data iterators of `setup`, `get_forward_backward_func` of train and eval.
- `forward_step` (forward.py): Bridge's GPT loss on one planned microbatch.

Importing the package needs megatron-core; megatron-bridge is imported when `with_dhp`, `pretrain` or `forward_step`
runs, or with `megatron_dhp.bridge.container`.
"""

from megatron_dhp.bridge.args import bridge_args, validate
from megatron_dhp.bridge.config import DhpConfig, DhpSection, dhp_of, with_dhp
from megatron_dhp.bridge.forward import forward_step
from megatron_dhp.bridge.seams import pretrain

__all__ = ["DhpConfig", "DhpSection", "bridge_args", "dhp_of", "forward_step", "pretrain", "validate", "with_dhp"]
