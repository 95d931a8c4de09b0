"""What each spawned rank of `test_bridge.py` runs: the example recipe through Bridge's `pretrain`, alone or
with megatron-dhp, on gloo CPU ranks; it returns the per-step training losses and the validation loss. `recipe` is
the same recipe in the test process (`test_config.py`)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bridge_llama_dhp.py"

SIZES = {"seq_length": 64, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 128, "train_iters": 3,
         "global_batch": 4, "micro_batch": 1, "lr": 1e-3}
"""The recipe at CPU size: 3 steps of 4 sequences of 64 tokens."""


def recipe(**changes: Any) -> Any:
    """The example script's recipe at `SIZES` (with `changes`), as the CPU runs it, with one validation step."""
    from tests.bridge.cpu_harness import cpu_config

    spec = importlib.util.spec_from_file_location("bridge_llama_dhp", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cfg = cpu_config(script.llama_config(**{**SIZES, **changes}))
    cfg.validation.eval_iters = 1
    cfg.validation.eval_interval = SIZES["train_iters"]
    return cfg


def train(dhp: dict | None = None, changes: dict | None = None, save_config: str | None = None) -> dict:
    """One rank of a Bridge run of the recipe (with megatron-dhp when `dhp` holds `DhpConfig` keys): its losses.
    With `save_config`, Bridge's setup writes the run's config there (`logger.save_config_filepath`, rank 0)."""
    warnings.filterwarnings("ignore")
    from tests.bridge.cpu_harness import apply_bridge_cpu_compat

    apply_bridge_cpu_compat()
    from megatron.bridge.training.callbacks import Callback

    class Losses(Callback):
        def __init__(self) -> None:
            self.train: list[float] = []
            self.eval: list[float] = []

        def on_train_step_end(self, context: Any) -> None:
            if context.loss_dict:
                self.train.append(float(context.loss_dict["lm loss"]))

        def on_eval_end(self, context: Any) -> None:
            if context.total_loss_dict:
                self.eval.append(float(context.total_loss_dict["lm loss"]))

    losses = Losses()
    cfg = recipe(**(changes or {}))
    cfg.logger.save_config_filepath = save_config
    if dhp is None:
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain

        pretrain(cfg, forward_step, callbacks=[losses])
    else:
        from megatron_dhp.bridge import DhpConfig, forward_step, pretrain, with_dhp

        pretrain(with_dhp(cfg, DhpConfig(**dhp)), forward_step, callbacks=[losses])
    return {"train": losses.train, "eval": losses.eval}
