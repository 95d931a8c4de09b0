"""`DhpConfigContainer`: Bridge's `ConfigContainer` with a `dhp` field, what `with_dhp` returns (config.py).

A dataclass field, so Bridge handles the section as it handles its own: `process_config_with_overrides` and
`apply_overrides` set `dhp.<key>` from a YAML file or `dhp.<key>=value` overrides, `to_yaml` / `print_yaml` (and
the `run_config.yaml` Bridge saves with each checkpoint) write it, `DhpConfigContainer.from_yaml` reads it back.
Importing this module imports megatron-bridge.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix
from megatron.training.config.instantiate_utils import InstantiationMode

from megatron_dhp.bridge.config import DhpSection
from megatron_dhp.integration.dhp_config import DhpConfig

TARGET_PREFIX = "megatron_dhp.bridge."
"""Where the saved config's `_target_`s of this container and its `DhpSection` live; Bridge instantiates only
targets under prefixes it was told of."""


@dataclasses.dataclass(kw_only=True)
class DhpConfigContainer(ConfigContainer):
    """A Bridge `ConfigContainer` trained with dynamic hybrid parallelism (`megatron_dhp.bridge.pretrain`)."""

    dhp: DhpSection
    """The settings of dynamic hybrid parallelism: `DhpConfig`'s keys (a `DhpConfig` given here is held as its
    `DhpSection`); `dhp_of(config)` reads them as a checked `DhpConfig`. Required, so a saved run config read
    without its `dhp` section fails instead of training with the defaults."""

    def __post_init__(self) -> None:
        if isinstance(self.dhp, DhpConfig):
            self.dhp = DhpSection.of(self.dhp)

    @classmethod
    def wrap(cls, config: ConfigContainer, dhp: DhpConfig) -> DhpConfigContainer:
        """`config`'s sections (the same objects) and its other attributes, with `dhp` as the `dhp` section."""
        init = {f.name for f in dataclasses.fields(config) if f.init} - {"dhp"}
        wrapped = cls(**{name: getattr(config, name) for name in init}, dhp=dhp)
        for name, value in vars(config).items():
            if name not in init and name != "dhp":
                setattr(wrapped, name, value)
        return wrapped

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any],
                  mode: InstantiationMode = InstantiationMode.STRICT) -> DhpConfigContainer:
        """Bridge's `from_dict` (and so `from_yaml`), once the `_target_`s under `TARGET_PREFIX` are allowed."""
        register_allowed_target_prefix(TARGET_PREFIX)
        return super().from_dict(config_dict, mode=mode)
