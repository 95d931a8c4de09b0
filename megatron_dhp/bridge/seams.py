"""Bridge's `pretrain(config, forward_step)` with megatron-dhp at Bridge's own seams.

For the length of the call, and only then:

- the model provider's `transformer_layer_spec` resolves Bridge's choice and puts megatron-dhp's attention and RoPE
  over each microbatch's group into it (`megatron.layer_spec_provider`); the run config Bridge saves meanwhile
  (`logger.save_config_filepath`, `run_config.yaml` with each checkpoint) records Bridge's choice, which `pretrain`
  wraps again when a run starts from it;
- `setup` (as `megatron.bridge.training.pretrain` calls it) returns the data iterators as iterators of planned
  steps (`megatron.setup`: domain, group pool, planner), which write dhp's scalars to Bridge's TensorBoard and W&B
  writers at Bridge's steps;
- `get_forward_backward_func` of `train.py` and `eval.py` returns megatron-dhp's schedule
  (`megatron.dhp_forward_backward`), which runs the plan's microbatches, and under pipeline parallelism
  megatron-core's own 1F1B over them, as it does for Megatron-LM.

Each seam is a name Bridge's module looked up at import; the originals are back when `pretrain` returns.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from megatron_dhp.bridge.args import validate
from megatron_dhp.bridge.config import dhp_of
from megatron_dhp.megatron.arguments import route_mtp_blocks


def pretrain(config: Any, forward_step_func: Callable, callbacks: Any = None) -> None:
    """Bridge's `pretrain` with dynamic hybrid parallelism (`config` wrapped by `with_dhp`); `forward_step_func` is
    `megatron_dhp.bridge.forward_step` or one that hands its iterator and loss to `megatron.forward_step`.

    A setting that cannot work is one `DhpError` before anything starts.
    """
    from megatron.bridge.training import pretrain as bridge_pretrain

    args = validate(config)
    route_mtp_blocks(args, dhp_of(config))
    with _seams(config, args):
        bridge_pretrain.pretrain(config, forward_step_func, callbacks=callbacks)


@contextmanager
def _seams(config: Any, args: argparse.Namespace) -> Iterator[None]:
    from megatron.bridge.training import eval as bridge_eval
    from megatron.bridge.training import pretrain as bridge_pretrain
    from megatron.bridge.training import train as bridge_train

    from megatron_dhp.megatron import dhp_forward_backward, layer_spec_provider, setup
    from megatron_dhp.megatron.metrics import Writers

    def planned_setup(*a: Any, **k: Any) -> Any:
        out = original_setup(*a, **k)
        # dhp's scalars go to Bridge's writers (on its GlobalState, rank N-1's), numbered by its step
        args.iteration = out.state.train_state.step
        writers = Writers(out.state.tensorboard_logger, out.state.wandb_logger)
        train, valid, test = setup(args, out.train_data_iterator, out.valid_data_iterator, out.test_data_iterator,
                                   writers=writers)
        return out._replace(train_data_iterator=train, valid_data_iterator=valid, test_data_iterator=test)

    def schedule(*_: Any, **__: Any) -> Callable:
        return dhp_forward_backward

    original_setup = bridge_pretrain.setup
    with ExitStack() as stack:
        spec = config.model.transformer_layer_spec
        stack.enter_context(_replaced(config.model, "transformer_layer_spec",
                                      _SavedAs(layer_spec_provider(spec, args), spec)))
        stack.enter_context(_replaced(bridge_pretrain, "setup", planned_setup))
        stack.enter_context(_replaced(bridge_train, "get_forward_backward_func", schedule))
        stack.enter_context(_replaced(bridge_eval, "get_forward_backward_func", schedule))
        yield


class _SavedAs:
    """A layer spec provider that Bridge's config YAML writes as `saved` (`to_cfg_dict`, which Bridge's
    `ConfigContainer.to_dict` asks of any value that has it): a local function would be written as a `_target_` no
    one can load."""

    def __init__(self, provide: Callable, saved: Any) -> None:
        self.provide, self.saved = provide, saved

    def __call__(self, config: Any, vp_stage: int | None = None) -> Any:
        return self.provide(config, vp_stage=vp_stage)

    def to_cfg_dict(self) -> Any:
        from megatron.bridge.training.config import ConfigContainer

        return ConfigContainer._convert_value_to_dict(self.saved)


@contextmanager
def _replaced(owner: object, name: str, value: object) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
