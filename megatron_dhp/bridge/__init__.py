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

Names resolve on first use, so importing this package needs neither megatron-core nor megatron-bridge.
"""

import importlib

_EXPORTS = {
    "DhpConfig": "config",
    "dhp_of": "config",
    "with_dhp": "config",
    "bridge_args": "args",
    "validate": "args",
    "forward_step": "forward",
    "pretrain": "seams",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
