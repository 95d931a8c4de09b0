"""The `dhp` section of a Bridge `ConfigContainer`: a dataclass field that Bridge's own config machinery handles.

`with_dhp(config, DhpConfig(...))` returns the recipe as a `DhpConfigContainer` (container.py: Bridge's
`ConfigContainer` with a `dhp` field), so the section takes part in everything Bridge does with a container:
Hydra-style overrides (`dhp.max_tokens_per_rank=4096`, `process_config_with_overrides`), a recipe YAML's `dhp:`
section, the run config Bridge saves (`to_yaml`: `run_config.yaml` beside each checkpoint) and its loading
(`DhpConfigContainer.from_yaml`).

Bridge's overrides set a section's fields one by one (`setattr`), which `DhpConfig` (frozen, tuples) refuses; the
field therefore holds a `DhpSection`: `DhpConfig`'s fields, each with its default, on a mutable dataclass, like
every other section of the container. It is checked as a whole (`DhpConfig`'s checks) when built and when Bridge
validates the container, and `dhp_of(config)` returns it as the frozen `DhpConfig` the hooks read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig

__all__ = ["DhpConfig", "DhpSection", "dhp_of", "with_dhp"]


def _freeze(section: Any) -> DhpConfig:
    """The section as a checked `DhpConfig` (lists become tuples); a bad value is a `DhpError` naming `dhp`."""
    return DhpConfig.from_dict({f.name: getattr(section, f.name) for f in dataclasses.fields(section)}, source="dhp")


def _of(cls: type, dhp: DhpConfig) -> Any:
    """The section holding `dhp`'s values."""
    return cls(**{f.name: getattr(dhp, f.name) for f in dataclasses.fields(cls)})


def _post_init(section: Any) -> None:
    # Bridge's `ConfigContainer.validate` re-runs the `__post_init__` of each section without a `finalize`: the
    # values the overrides set are checked there too
    _freeze(section)


def _section_class() -> type:
    fields = dataclasses.fields(DhpConfig)
    assert all(f.default is not dataclasses.MISSING for f in fields), "every DhpConfig field has a plain default"
    return dataclasses.make_dataclass(
        "DhpSection", [(f.name, f.type, dataclasses.field(default=f.default)) for f in fields],
        namespace={"__doc__": "DhpConfig's fields, each with its default, on a mutable dataclass.",
                   "__module__": __name__, "__post_init__": _post_init, "freeze": _freeze, "of": classmethod(_of)})


DhpSection = _section_class()
"""`DhpConfig`'s fields on a mutable dataclass (what Bridge's overrides can set): `DhpSection.of(dhp)` holds a
`DhpConfig`'s values, `section.freeze()` is the checked `DhpConfig`."""


def with_dhp(config: Any, dhp: DhpConfig | None = None) -> Any:
    """`config` (a Bridge `ConfigContainer`) as a `DhpConfigContainer` with the `dhp` section (the defaults when
    None), sharing every other section with `config`; pass it to `megatron_dhp.bridge.pretrain`."""
    from megatron_dhp.bridge.container import DhpConfigContainer

    return DhpConfigContainer.wrap(config, dhp if dhp is not None else DhpConfig())


def dhp_of(config: Any) -> DhpConfig:
    """The `dhp` section of `config` as a checked `DhpConfig`, or a `DhpError` naming the fix when the recipe has
    none."""
    section = getattr(config, "dhp", None)
    if not isinstance(section, DhpSection):
        raise DhpError("the ConfigContainer has no dhp section: wrap the recipe as with_dhp(config, DhpConfig(...)) "
                       "before megatron_dhp.bridge.pretrain")
    return section.freeze()
