"""Megatron-Core attention modules for dynamic context parallelism.

`DynamicCPAttention` is a `core_attention` for megatron-core's layer spec (the `CoreAttentionBuilder` /
`CoreAttention` protocols of `megatron/core/transformer/attention.py`): it takes the microbatch's group and
token layout from `DhpPackedSeqParams.dhp` and runs causal attention over exactly the group's ranks with
the requested communication variant. `DynamicCPSelfAttention` is megatron's `SelfAttention` with one
change: while it runs, the `cp` entry of its process-group collection is the microbatch's group, so
megatron's THD RoPE slices true positions for the dynamic group instead of the static one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.comm import COMM_VARIANTS
from megatron_dhp.runtime.attention.allgather import allgather_attention
from megatron_dhp.runtime.attention.context import CPContext, DhpPackedSeqParams
from megatron_dhp.runtime.attention.kernels import LocalKernel, resolve
from megatron_dhp.runtime.attention.ring import ring_attention
from megatron_dhp.runtime.attention.ulysses import no_heads, ulysses_attention
from megatron_dhp.runtime.rope import DynamicRopeGroup

Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, CPContext, LocalKernel, float], torch.Tensor]

VARIANTS: dict[str, Variant] = {
    "allgather": allgather_attention,
    "ring": ring_attention,
    "ulysses": ulysses_attention,
    "p2p": ring_attention,  # the same ring; its CPContext carries a PeerRing on the domain's communicator
}
assert VARIANTS.keys() == COMM_VARIANTS.keys(), "one function per name of runtime.attention.COMM_VARIANTS"


def dynamic_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, scale: float) -> torch.Tensor:
    """Causal attention of a rank's THD shards [t, h, dh] over its group; a one-rank group communicates nothing.
    Everything it reads besides q, k, v is the microbatch's `AttentionMeta` (`ctx.meta`): no host work."""
    kernel = resolve(ctx.backend, q)
    if ctx.group is None:
        return kernel.causal(q, k, v, ctx.meta.local, scale) if q.shape[1] else no_heads(q, k, v)
    return VARIANTS[ctx.comm](q, k, v, ctx, kernel, scale)


class DynamicCPAttention(MegatronModule):
    """Core attention over the current microbatch's dynamic context-parallel group (THD only)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise DhpError(
                f"DynamicCPAttention has no attention dropout (attention_dropout={dropout}); set attention_dropout=0.0"
            )
        if attention_type != "self" or attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise DhpError(
                f"DynamicCPAttention supports causal self-attention only (got {attention_type} with "
                f"{attn_mask_type.name}); use a causal GPT layer spec"
            )
        head_dim = k_channels or config.kv_channels  # MLA passes its query/key head (and a narrower v_channels)
        # apply_query_key_layer_scaling divides the scores by the layer number and the softmax multiplies
        # them back: the net scale is 1/sqrt(head_dim) either way.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.layer_number = layer_number

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: DhpPackedSeqParams | None = None,
    ) -> torch.Tensor:
        """[t, h, dh] query and [t, hk, dh] key/value of this rank's shards -> [t, h * dh]."""
        ctx = getattr(packed_seq_params, "dhp", None)
        if ctx is None:
            raise DhpError(
                "DynamicCPAttention needs THD input with DhpPackedSeqParams.for_microbatch(...); "
                "run the model through megatron_dhp.runtime.step"
            )
        if attention_bias is not None:
            raise DhpError("DynamicCPAttention does not take an attention bias; remove it from the model config")
        out = dynamic_cp_attention(query, key, value, ctx, self.softmax_scale)
        return out.reshape(out.shape[0], -1)


class _RoPEOnTheDynamicGroup:
    """An attention module whose RoPE (megatron's THD RoPE, reading the `cp` group of the module's collection)
    follows the microbatch's dynamic group."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, *args, **kwargs):  # noqa: D102
        params = kwargs.get("packed_seq_params")
        dhp = params.dhp if isinstance(params, DhpPackedSeqParams) else None
        rope = None if dhp is None else DynamicRopeGroup(params.cp_group, dhp.meta.positions, dhp.layout.uneven)
        with _cp_group_for_rope(self.pg_collection, rope):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)


class DynamicCPSelfAttention(_RoPEOnTheDynamicGroup, SelfAttention):
    """Megatron's SelfAttention whose RoPE follows the microbatch's dynamic group."""


class DynamicCPMLASelfAttention(_RoPEOnTheDynamicGroup, MLASelfAttention):
    """Megatron's multi-latent attention (DeepSeek's MLA: low-rank K/V, a separate RoPE part, V narrower than
    Q/K) whose RoPE follows the microbatch's dynamic group. megatron-core's MLA refuses packed parameters
    that carry `local_cp_size` (its own hybrid CP, which TE's attention reads); megatron-dhp's core attention
    takes the group from `DhpPackedSeqParams.dhp` instead, so MLA gets the parameters without it. And MLA
    cuts its RoPE table to the local length unless the config's static CP size is above 1
    (multi_latent_attention.py:779), which would drop the positions of a shard's back chunk: while a
    microbatch on a group of d > 1 runs, the config says d."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, *args, **kwargs):  # noqa: D102
        params = kwargs.get("packed_seq_params")
        if not isinstance(params, DhpPackedSeqParams) or params.dhp is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        kwargs["packed_seq_params"] = dataclasses.replace(params, local_cp_size=None)
        static = self.config.context_parallel_size
        self.config.context_parallel_size = params.dhp.layout.group_size
        try:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            self.config.context_parallel_size = static


@contextmanager
def _cp_group_for_rope(pgs: ProcessGroupCollection, group: DynamicRopeGroup | None) -> Iterator[None]:
    """Let megatron's THD RoPE see the microbatch's group and its rows' positions (`runtime.rope`; None: keep
    the static CP group of size 1, not a megatron-dhp microbatch). RoPE asks only `size()` and `rank()`.

    The collection object is shared by every layer of the model, so the swap is undone as soon as this
    layer's forward returns; RoPE's backward needs no group, so nothing else can observe it.
    """
    if group is None:
        yield
        return
    static = pgs.cp
    pgs.cp = group
    try:
        yield
    finally:
        pgs.cp = static
