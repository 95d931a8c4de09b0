"""Multi-token prediction under dynamic groups: megatron-core's token roll on the microbatch's own layout.

An MTP layer of depth k reads token i + k at position i: megatron-core rolls the input ids, position ids,
labels and loss mask left by one per depth (`roll_tensor`), passing boundary tokens between context-parallel
ranks. Its packed-sequence path finds each sample's shard from `cu_seqlens_q // cp_size`, which holds only for
samples that need no padding, and takes the static CP group. Here the roll follows the microbatch's
`MicrobatchLayout` (padded zigzag shards, any group size) over the slot's own group: within each local
chunk every slot takes its successor; the last slot of a sample's front chunk c_r takes the first of chunk
c_(r+1), which rank r+1 holds in front (the group's last rank: its own back chunk), and the last slot of its
back chunk c_(2d-1-r) takes the first of c_(2d-r), rank r-1's back chunk (rank 0: the sample's end, 0). Padding
sits at each sample's end with loss mask 0, so the roll across it zeroes the last real position's target as
one process does at the end of a sample.

`install` swaps megatron-core's `roll_tensor` (in the MTP module and in the GPT model that imported it) for
`roll_tensor`, which takes this path for a microbatch of megatron-dhp's (`DhpPackedSeqParams`) and leaves
every other call to megatron-core.
"""

from __future__ import annotations

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention.comm import PeerRing, start_shift
from megatron_dhp.runtime.attention.context import CPContext, DhpPackedSeqParams
from megatron_dhp.runtime.layout import MicrobatchLayout

_MODULES = ("megatron.core.transformer.multi_token_prediction", "megatron.core.models.gpt.gpt_model")
_ORIGINAL: dict[str, object] = {}


def roll_left(x: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """`x` [..., t] on this rank's slots with every slot holding its sample's next position's value (0 past
    the sample's end), as `ctx`'s layout places the samples over its group."""
    cu = ctx.meta.local.cu  # the microbatch's metadata, already on the device: no copy inside the forward
    if ctx.layout.group_size == 1:
        return rolled(x, ctx.layout, cu)
    front_first, back_first = chunk_firsts(x, cu)
    from_next = start_shift(front_first, _reversed(ctx.group)).wait()  # rank r+1's front firsts
    from_previous = start_shift(back_first, ctx.group).wait()  # rank r-1's back firsts
    return rolled(x, ctx.layout, cu, from_next, from_previous)


def _chunks(local_cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each sample's shard starts, where its back chunk starts (halfway) and where it ends, locally, from
    the cumulative local shard lengths on the device (`AttentionMeta.local.cu`)."""
    cu = local_cu.long()
    starts, ends = cu[:-1], cu[1:]
    return starts, starts + (ends - starts) // 2, ends


def chunk_firsts(x: torch.Tensor, local_cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first slot of each sample's front and back chunk: what this rank sends back and forth."""
    starts, backs, _ = _chunks(local_cu)
    return x[..., starts].contiguous(), x[..., backs].contiguous()


def rolled(x: torch.Tensor, layout: MicrobatchLayout, local_cu: torch.Tensor, from_next: torch.Tensor | None = None,
           from_previous: torch.Tensor | None = None) -> torch.Tensor:
    """The roll from this rank's slots and its neighbours' `chunk_firsts` (rank r+1's front firsts, rank
    r-1's back firsts; unused at the group's ends, and for a group of one)."""
    out = torch.zeros_like(x)
    out[..., :-1] = x[..., 1:]
    _, backs, ends = _chunks(local_cu)
    if layout.group_size > 1:
        out[..., backs - 1] = x[..., backs] if layout.rank == layout.group_size - 1 else from_next
    out[..., ends - 1] = 0 if layout.rank == 0 else from_previous
    return out


def _reversed(group) -> PeerRing:
    """The group as a ring in the other direction (its `start_shift` sends to the rank before)."""
    peers = group if isinstance(group, PeerRing) else PeerRing.of_group(group)
    return PeerRing(peers.members[::-1], len(peers.members) - 1 - peers.index, peers.group)


def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """megatron-core's `roll_tensor` (rolled tensor and its sum), on the layout of a megatron-dhp microbatch."""
    if isinstance(packed_seq_params, DhpPackedSeqParams) and packed_seq_params.dhp is not None:
        assert shifts == -1 and dims in (-1, tensor.dim() - 1), "multi-token prediction rolls one token left"
        out = roll_left(tensor, packed_seq_params.dhp)
        return out, out.sum()
    return _ORIGINAL[_MODULES[0]](tensor, shifts, dims, cp_group, packed_seq_params)


def install() -> None:
    """Route megatron-core's MTP rolls through `roll_tensor` (idempotent); a megatron-core whose roll has another
    form (the dev branch rolls a list of tensors with fill values) is refused in one line."""
    import importlib
    import inspect

    for name in _MODULES:
        module = importlib.import_module(name)
        if not hasattr(module, "roll_tensor"):  # 0.19's GPT model leaves every roll to the MTP module
            continue
        if module.roll_tensor is not roll_tensor:
            first = next(iter(inspect.signature(module.roll_tensor).parameters))
            if first != "tensor":
                raise DhpError(
                    f"--mtp-num-layers with --dhp: this megatron-core's {name}.roll_tensor takes "
                    f"{first!r} (a list of tensors), a form megatron-dhp's token roll does not follow (it follows "
                    "megatron-core 0.16 to 0.20, which roll one tensor); train without --mtp-num-layers or with a "
                    "released megatron-core"
                )
            _ORIGINAL.setdefault(name, module.roll_tensor)
            module.roll_tensor = roll_tensor

