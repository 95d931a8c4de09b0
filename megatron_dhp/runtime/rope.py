"""RoPE on the dynamic layout with no host sync: each row's frequencies taken by its true position.

megatron-core's unfused THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`) finds each sample's shard with
`cu_seqlens.tolist()` and one `.item()` per sample: two host syncs per layer (query and key) and a Python loop
over samples. A megatron-dhp microbatch already knows every local row's true position (`AttentionMeta.
positions`, on the device once per microbatch), so its frequencies are one gather, `freqs[positions]`, and
the rotation megatron's own `_apply_rotary_pos_emb_bshd`: the same values as megatron's slices, bit for bit.

While a megatron-dhp microbatch's attention runs, the module's `cp` group is a `DynamicRopeGroup` (its
group's size and rank, and the positions); `install` routes megatron-core's `apply_rotary_pos_emb` (as the
attention and MLA modules imported it) through `apply_rotary_pos_emb` here, which takes this path for such a
group and leaves everything else, megatron's fused RoPE (TransformerEngine's THD kernel, sync-free) included,
to the original. The fused kernel finds a rank's shard as even zigzag (padded / d), so a microbatch of uneven
shards takes the row-wise path whatever `apply_rope_fusion` says.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings import rope_utils

_MODULES = ("megatron.core.transformer.attention", "megatron.core.transformer.multi_latent_attention")
_ORIGINAL = rope_utils.apply_rotary_pos_emb
_APPLY_OPTIONS = inspect.signature(rope_utils.apply_rotary_pos_emb).parameters
_BSHD_OPTIONS = set(inspect.signature(rope_utils._apply_rotary_pos_emb_bshd).parameters)
_MLA_OPTION = "mla_rotary_interleaved" if "mla_rotary_interleaved" in _BSHD_OPTIONS else "multi_latent_attention"
"""The row-wise rotation's name for MLA's interleaving (0.19 renamed it)."""


@dataclass(frozen=True)
class DynamicRopeGroup:
    """What megatron's RoPE asks of a CP group (`size()`, `rank()`), for a microbatch's dynamic group (None: one
    rank), with the true position of each local row."""

    group: object | None
    positions: torch.Tensor
    uneven: bool = False
    """Whether the group's ranks hold uneven shards (`MicrobatchLayout.uneven`): megatron's RoPE cannot find them."""

    def size(self) -> int:  # noqa: D102
        return 1 if self.group is None else self.group.size()

    def rank(self) -> int:  # noqa: D102
        return 0 if self.group is None else self.group.rank()


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens: torch.Tensor | None = None,
                         mscale: float = 1.0, cp_group=None, **options) -> torch.Tensor:
    """megatron-core's `apply_rotary_pos_emb`; for a THD microbatch of megatron-dhp's (unfused) by position.

    `options` are what later megatron-cores add (0.19: `mla_rotary_interleaved`; 0.20: `inverse`,
    `mla_output_remove_interleaving`, `max_seqlen`): passed on to megatron-core as given, and on the dynamic
    path those the row-wise rotation takes, with MLA's interleaving named as this version names it."""
    by_position = isinstance(cp_group, DynamicRopeGroup) and (cp_group.uneven or not config.apply_rope_fusion)
    if by_position and cu_seqlens is not None:
        style = {key: value for key, value in options.items() if key in _BSHD_OPTIONS}
        style[_MLA_OPTION] = _mla_interleaved(config, options)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[cp_group.positions], rotary_interleaved=config.rotary_interleaved, mscale=mscale,
            **style,
        ).squeeze(1)
    return _ORIGINAL(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **options)


def _mla_interleaved(config, options: dict) -> bool:
    """MLA's interleaving as this megatron-core decides it: from 0.19 on the caller's argument (None: the config's
    `multi_latent_attention`), before that the config alone."""
    if "mla_rotary_interleaved" not in _APPLY_OPTIONS:
        return config.multi_latent_attention
    asked = options.get("mla_rotary_interleaved", _APPLY_OPTIONS["mla_rotary_interleaved"].default)
    return config.multi_latent_attention if asked is None else asked


def install() -> None:
    """Route megatron-core's attention modules' RoPE through `apply_rotary_pos_emb` (idempotent)."""
    for name in _MODULES:
        module = importlib.import_module(name)
        if getattr(module, "apply_rotary_pos_emb", None) is _ORIGINAL:
            module.apply_rotary_pos_emb = apply_rotary_pos_emb
