"""The per-microbatch bundle handed to dynamic-CP attention through `PackedSeqParams`.

The group changes every microbatch, so attention must not read it from a module global (which cannot
follow groups that change between phases or interleave under pipelining); the step builds one frozen
`CPContext` per microbatch and passes it down with the packed-sequence parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.comm import COMM_VARIANTS, DOMAIN_COMMS
from megatron_dhp.runtime.attention import BACKENDS
from megatron_dhp.runtime.attention.comm import PeerRing
from megatron_dhp.runtime.attention.meta import AttentionMeta
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.runtime.nvtx import METADATA, nvtx_range


@dataclass(frozen=True)
class CPContext:
    """Which ranks attend together for this microbatch, where its tokens are, and how to communicate."""

    layout: MicrobatchLayout
    group: dist.ProcessGroup | PeerRing | None
    """The group's process group, or its `PeerRing` on the domain's communicator under a `DOMAIN_COMMS`
    variant; None exactly when the group is one rank (no communication at all)."""
    comm: str = "allgather"
    """`allgather` (K/V all-gather, dK/dV reduce-scatter), `ring` (P2P K/V ring), `ulysses` (all-to-all) or
    `p2p` (the ring on the domain's communicator)."""
    backend: str = "auto"
    """Local attention kernel (`attention.BACKENDS`; `auto` resolves by device and dtype, `kernels.resolve`)."""
    device: torch.device | str = "cpu"
    """Where the microbatch's tokens are: its `meta` is moved there."""
    meta: AttentionMeta = field(init=False, repr=False)
    """What every layer's attention reads, built here once per microbatch (`AttentionMeta.build`)."""

    def __post_init__(self) -> None:
        if self.comm not in COMM_VARIANTS:
            raise DhpError(f"context-parallel comm {self.comm!r} is unknown; use one of {', '.join(COMM_VARIANTS)}")
        if self.backend not in BACKENDS:
            raise DhpError(f"attention backend {self.backend!r} is unknown; use one of {', '.join(BACKENDS)}")
        if self.group is not None and isinstance(self.group, PeerRing) != (self.comm in DOMAIN_COMMS):
            wanted = "a PeerRing" if self.comm in DOMAIN_COMMS else "a process group"
            raise DhpError(f"comm {self.comm!r} runs on {wanted}, got {type(self.group).__name__}")
        size = 1 if self.group is None else self.group.size()
        assert size == self.layout.group_size, f"group of {size} ranks for a layout of {self.layout.group_size}"
        assert self.group is None or self.group.rank() == self.layout.rank, "layout rank is not the group rank"
        with nvtx_range(METADATA):
            object.__setattr__(self, "meta", AttentionMeta.build(self.layout, self.device))


@dataclass
class DhpPackedSeqParams(PackedSeqParams):
    """Megatron's THD parameters plus the microbatch's `CPContext`.

    The inherited fields follow TransformerEngine's THD context-parallel convention (true and padded
    cumulative lengths of whole samples, `cp_group`, `local_cp_size`), so Megatron's RoPE and TE read
    the same layout as megatron-dhp's own attention. Under `p2p`, `cp_group` is the group's `PeerRing`:
    RoPE asks it only `size()` and `rank()`; TE would need a process group, so `p2p` is local-spec only.
    """

    pad_between_seqs: bool | None = None
    """Whether any sample carries padding, stated so that TE need not infer it (`attention.te`); a field of
    megatron-core's own from 0.19."""
    dhp: CPContext | None = None

    @classmethod
    def for_microbatch(cls, ctx: CPContext) -> DhpPackedSeqParams:
        """The parameters of one microbatch, their length tensors those its metadata already moved to its device
        (one tensor for true and padded lengths when no sample is padded)."""
        layout, meta = ctx.layout, ctx.meta
        cu = meta.cu_seqlens
        cu_padded = meta.natural.cu if layout.padded else cu
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=layout.max_seqlen,
            max_seqlen_kv=layout.max_seqlen,
            local_cp_size=layout.group_size,
            cp_group=ctx.group,
            pad_between_seqs=layout.padded,
            dhp=ctx,
        )
