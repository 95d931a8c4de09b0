"""Megatron-LM integration: the calls a hooked Megatron-LM checkout makes into megatron-dhp.

In the order a run meets them (file names of the upstream checkout; `sites.py` finds where each goes,
`patching.py` writes them, `run.py` makes them in memory at import):

- `with_dhp_args` (arguments.py, parse_args): the `--dhp*` flags, beside the script's extra_args_provider.
- `validate_dhp_args` (the end of Megatron's own validate_args): combinations that cannot work, raised as
  `DhpError`; `refuse_or_config` prints them once (rank 0) and exits 2 on every rank instead.
- `layer_spec` (gpt_builders.py; `layer_spec_provider` in 0.19+'s pretrain_gpt.py): attention and RoPE
  over each microbatch's dynamic group.
- `setup` (training.py, pretrain, once the data iterators exist): domain, group pool, planner, and the data
  iterators as iterators of planned steps (kept inside Megatron's RerunDataIterator) that carry them to
  the schedule. `layer_spec` and `setup` stop on a `DhpError` as `refuse_or_config` does.
- `dhp_forward_backward` (training.py, train and evaluate): the schedule of one planned step.
- `forward_step` (pretrain_gpt.py's forward_step): one planned microbatch through the model.

Names resolve on first use, so `megatron-dhp apply-patches` and the flag parser work without megatron-core.
"""

import importlib

_EXPORTS = {
    "add_dhp_args": "arguments",
    "dhp_config_from_args": "arguments",
    "refuse_or_config": "arguments",
    "validate_dhp_args": "arguments",
    "with_dhp_args": "arguments",
    "forward_step": "forward",
    "dhp_forward_backward": "schedule",
    "layer_spec": "hooks",
    "layer_spec_provider": "hooks",
    "setup": "hooks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
