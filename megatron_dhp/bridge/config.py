"""The `dhp` section of a Bridge `ConfigContainer`: a `DhpConfig` carried on the container itself.

Bridge's `ConfigContainer` is a fixed dataclass; the section rides on it as an attribute (not a dataclass field),
so Bridge's own validation, YAML dump and overrides leave it alone and a recipe stays one object.
"""

from __future__ import annotations

from typing import Any

from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig

__all__ = ["DhpConfig", "dhp_of", "with_dhp"]

_SECTION = "dhp"


def with_dhp(config: Any, dhp: DhpConfig | None = None) -> Any:
    """`config` (a Bridge `ConfigContainer`, changed in place and returned) trained with dynamic hybrid parallelism
    under `dhp` (the defaults when None); pass it to `megatron_dhp.bridge.pretrain`."""
    setattr(config, _SECTION, dhp if dhp is not None else DhpConfig())
    return config


def dhp_of(config: Any) -> DhpConfig:
    """The `dhp` section of `config`, or a `DhpError` naming the fix when the recipe has none."""
    dhp = getattr(config, _SECTION, None)
    if not isinstance(dhp, DhpConfig):
        raise DhpError("the ConfigContainer has no dhp section: wrap the recipe as with_dhp(config, DhpConfig(...)) "
                       "before megatron_dhp.bridge.pretrain")
    return dhp
