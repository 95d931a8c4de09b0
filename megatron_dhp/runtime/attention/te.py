"""TransformerEngine's core attention (`layer_spec: te`) over each microbatch's dynamic group.

megatron-core's `TEDotProductAttention` hands TE the microbatch's group (`PackedSeqParams.cp_group`), but three
things it leaves to TE's defaults are wrong under dynamic groups, so the `te` layer spec's attention is a
subclass that sets them:

- the comm type: megatron-core passes `cp_comm_type` to TE only when the static CP size is above 1 (never
  under megatron-dhp), and its per-call group switch hands TE TE's own default, p2p;
- the padding: TE infers `pad_between_seqs` from the cumulative lengths when it is not given, with two
  `torch.equal` host syncs per layer up to TE 2.17 (and wrongly for tail padding in 2.16, TE #3331), and by
  tensor identity from 2.18, which sends separate but equal tensors down its slow path (TE #3487). The
  microbatch states it (`DhpPackedSeqParams.pad_between_seqs`, known on the host), and a microbatch without
  padding passes one tensor for both;
- the version: each comm type's THD context parallelism needs a TE of at least `TE_FLOORS`.

No sequence of a microbatch is empty (every sample has a token, an idle slot one), so TE's fused RoPE never
meets the zero-length sequences that slow it (TE #2599).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_dhp.errors import DhpError

TE_FLOORS: dict[str, str] = {"p2p": "2.2", "all_gather": "2.18"}
"""The comm types TransformerEngine's attention runs over dynamic groups, each with the first TE release that
runs its THD context parallelism and takes `pad_between_seqs` per call: p2p's THD ring is older (1.7), the
argument came in 2.2; all_gather's THD path in 2.18. a2a (THD since 2.10) needs the group size to divide the
attention heads, which groups of any size do not; a2a+p2p has no THD path in any release (2.18)."""


def te_unsupported(comm_types: str | Sequence[str | None] | None) -> list[str]:
    """The given comm types (one, or one per layer; None is TE's default, p2p) dynamic groups cannot run."""
    kinds = [comm_types] if comm_types is None or isinstance(comm_types, str) else list(comm_types)
    return sorted({kind for kind in kinds if (kind or "p2p") not in TE_FLOORS})


def te_refusal(comm_types: str | Sequence[str | None] | None, version: str) -> str | None:
    """Why TransformerEngine `version` cannot run these comm types under dynamic groups, or None when it can."""
    from packaging.version import Version

    unsupported = te_unsupported(comm_types)
    if unsupported:
        return (f"--cp-comm-type {' '.join(unsupported)} with layer_spec te: TransformerEngine's attention runs "
                f"dynamic groups of any size only with {' or '.join(TE_FLOORS)}; set --cp-comm-type p2p or all_gather")
    kinds = [comm_types] if comm_types is None or isinstance(comm_types, str) else list(comm_types)
    for kind in dict.fromkeys(k or "p2p" for k in kinds):
        if Version(version) < Version(TE_FLOORS[kind]):
            return (f"TransformerEngine {version} is older than {TE_FLOORS[kind]}, the first release that runs "
                    f"--cp-comm-type {kind} on THD microbatches with the padding stated; upgrade it, or use "
                    "layer_spec local")
    return None


def te_version() -> str:
    """The installed TransformerEngine's version."""
    from importlib.metadata import version

    return version("transformer_engine")


def dynamic_te_attention(te_attention: type) -> type:
    """TE's core attention class (megatron-core's `TEDotProductAttention` or a subclass) taking the job's comm
    type, each microbatch's stated padding, and refusing a TE below the comm type's floor at construction."""
    te_base = te_attention.__mro__[1]  # TE's own DotProductAttention, which megatron-core's forward calls

    class StatedPadding(te_base):
        """Between megatron-core's forward and TE's: adds the microbatch's `pad_between_seqs` (megatron-core
        < 0.19 has no such field to pass; from 0.19 it is passed already)."""

        def forward(self, *args, **kwargs):
            if self.dhp_pad_between_seqs is not None:
                kwargs.setdefault("pad_between_seqs", self.dhp_pad_between_seqs)
            return super().forward(*args, **kwargs)

    class DynamicTEAttention(te_attention, StatedPadding):
        dhp_dynamic = True
        dhp_pad_between_seqs: bool | None = None

        def __init__(self, config, layer_number: int, *args, **kwargs) -> None:
            super().__init__(config, layer_number, *args, **kwargs)
            kind = config.cp_comm_type
            self.cp_comm_type = (kind[layer_number - 1] if isinstance(kind, list) else kind) or "p2p"
            problem = te_refusal(self.cp_comm_type, te_version())
            if problem:
                raise DhpError(problem)

        def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            self.dhp_pad_between_seqs = getattr(packed_seq_params, "pad_between_seqs", None)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params, **kwargs)

    DynamicTEAttention.__name__ = DynamicTEAttention.__qualname__ = f"Dynamic{te_attention.__name__}"
    return DynamicTEAttention
