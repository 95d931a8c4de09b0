"""Images of a step: which ranks encode them, pixels to those ranks, embeddings to the ranks of the LLM tokens.

The plan places every sample's LLM tokens (zigzag over its group); the encoder placement places its images:

- `split`: the images of a group's samples spread over the group's ranks (longest first to the least
  loaded), embeddings sent inside the group (LongVILA's MM-SP);
- `replicate`: every rank of the group encodes all of the group's images and keeps the rows it holds
  (upstream CP, the DHP authors' code): no embedding moves, pixels go to every member;
- `global`: the images of the whole batch spread over the whole domain (OrchMLLM, MindSpeed-MM), then an
  all-to-all of embeddings to the LLM owners.

Execution is the same for all three (`step.run_step`): each rank encodes its images once, before the step's
first microbatch; one all-to-all over the domain moves the embedding rows the LLM positions need; every
microbatch fills its image rows from them; after the last microbatch the embeddings' gradients go back in
one all-to-all and the encoder's backward runs once. No collective runs inside a microbatch's autograd, so
ranks with different microbatch counts never wait for each other there. Loss and every gradient (encoder
and projector included) equal one process's: a rank's encoder sees only the gradient of the rows it sent,
and megatron DDP's sum over the domain adds up every image's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.collectives import all_to_all_rows
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.layout import SlotRows, microbatches_of
from megatron_dhp.runtime.step_data import GatheredBatch, GatheredImage, TokenSample, VisionInputs

ImageKey = tuple[int, int]


def encoder_ranks(plan: Plan, images: Sequence[GatheredImage], placement: str) -> dict[ImageKey, tuple[int, ...]]:
    """The domain positions that encode each image under `placement` (one, or the whole group for replicate).

    Longest first (by encoder tokens) to the least loaded rank, ties to the lowest position: a pure function
    of the plan and the gathered images, so every rank computes the same answer without a collective.
    """
    if placement not in CONCRETE_PLACEMENTS:  # a plan's `auto` was resolved to one of them by its planner
        raise DhpError(f"encoder placement {placement!r} is unknown; the runtime runs {', '.join(CONCRETE_PLACEMENTS)}")
    group_of = {sid: tuple(sorted(g.ranks)) for g in plan.groups for mb in g.microbatches for sid in mb}
    if placement == "replicate":
        return {im.key: group_of[im.sample_id] for im in images}
    pools: dict[tuple[int, ...], list[GatheredImage]] = {}
    for im in images:
        pools.setdefault(group_of[im.sample_id] if placement == "split" else tuple(range(plan.world_size)), []).append(im)
    out: dict[ImageKey, tuple[int, ...]] = {}
    for ranks, pool in pools.items():
        load = dict.fromkeys(ranks, 0)
        for im in sorted(pool, key=lambda im: (-im.enc_tokens, im.key)):
            rank = min(ranks, key=lambda r: (load[r], r))
            load[rank] += im.enc_tokens
            out[im.key] = (rank,)
    return out


def move_images(local: Sequence[TokenSample], plan: Plan, gathered: GatheredBatch, domain: DynamicDomain, *,
                placement: str, seq_multiple: int = 1, slot_rows: SlotRows | None = None) -> VisionInputs:
    """Send every image's pixels to the ranks that encode it and work out the embedding exchange. Collective."""
    encoders = encoder_ranks(plan, gathered.images, placement)
    send_rows, requests = _routes(plan, gathered, encoders, domain.position, domain.size, seq_multiple, slot_rows)
    all_sources = torch.cat([s for _, s in requests] or [torch.empty(0, dtype=torch.int64)])
    # the receive buffer is grouped by source, each source's rows in this rank's request order
    position = torch.empty_like(all_sources)
    position[torch.argsort(all_sources, stable=True)] = torch.arange(all_sources.numel())
    microbatch_rows, start = [], 0
    for slots, _ in requests:
        microbatch_rows.append((slots, position[start:start + slots.numel()]))
        start += slots.numel()
    return VisionInputs(
        pixels=_move_pixels(local, gathered, encoders, domain),
        send_rows=torch.cat([t for part in send_rows for t in part] or [torch.empty(0, dtype=torch.int64)]),
        send_counts=[sum(int(t.numel()) for t in part) for part in send_rows],
        recv_counts=torch.bincount(all_sources, minlength=domain.size).tolist(),
        microbatch_rows=tuple(microbatch_rows),
    )


def _move_pixels(local: Sequence[TokenSample], gathered: GatheredBatch, encoders: dict[ImageKey, tuple[int, ...]],
                 domain: DynamicDomain) -> torch.Tensor:
    """The tiles of the images this rank encodes, in canonical order: each owner sends each image to each of
    its encoders (one all-to-all)."""
    me, n = domain.position, domain.size
    mine = [im for im in gathered.images if me in encoders[im.key]]
    pixels_of = {(s.id, k): im.pixels for s in local for k, im in enumerate(s.images)}
    send = [[pixels_of[im.key] for im in gathered.images if im.owner == me and dest in encoders[im.key]] for dest in range(n)]
    tiles = torch.cat([torch.empty(0, *gathered.images[0].tile_shape), *(p for part in send for p in part)])
    recv_tiles = [sum(im.tiles for im in mine if im.owner == src) for src in range(n)]
    flat = all_to_all_rows(tiles, [sum(p.shape[0] for p in part) for part in send], recv_tiles, domain)
    # received tiles come grouped by owner; put them back in canonical order
    starts = _offsets([im.tiles for im in mine])
    by_owner = sorted(range(len(mine)), key=lambda i: (mine[i].owner, i))
    order = torch.cat([torch.arange(starts[i], starts[i] + mine[i].tiles) for i in by_owner] or [torch.empty(0, dtype=torch.int64)])
    pixels = torch.empty_like(flat)
    pixels[order.to(flat.device)] = flat
    return pixels


def _routes(plan: Plan, gathered: GatheredBatch, encoders: dict[ImageKey, tuple[int, ...]], me: int, n: int,
            seq_multiple: int, slot_rows: SlotRows | None) -> tuple[list[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Where every image row goes: the rows of this rank's encoder output it sends to each destination, in
    that destination's request order; and per microbatch of this rank, its image slots and each slot's source.

    Every rank works this out for every destination from the plan alone, so sender and receiver agree on the
    order without a message. An encoder's output holds its images' rows back to back, in canonical order; a
    rank that encodes an image itself (replicate) takes its rows from its own output."""
    row_of: dict[ImageKey, dict[int, int]] = {}
    for rank in range(n):
        keys = [im.key for im in gathered.images if rank in encoders[im.key]]
        offsets = _offsets([im.llm_tokens for im in gathered.images if rank in encoders[im.key]])
        for key, first in zip(keys, offsets):
            row_of.setdefault(key, {})[rank] = first
    lengths = {s.id: s.tokens for s in gathered.batch.samples}
    images_of: dict[int, list[GatheredImage]] = {}
    for im in gathered.images:
        images_of.setdefault(im.sample_id, []).append(im)
    send_rows: list[list[torch.Tensor]] = [[] for _ in range(n)]
    requests: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dest in range(n):
        for layout, _, _ in microbatches_of(plan, dest, lengths, seq_multiple, slot_rows):
            slots, sources, rows = [], [], []
            for i, sid in enumerate(layout.sample_ids):
                positions = layout.sample_positions(i)
                base = int(layout.local_cu_seqlens[i])
                for im in images_of.get(sid, ()):
                    held = torch.nonzero((positions >= im.start) & (positions < im.start + im.llm_tokens)).view(-1)
                    source = dest if dest in encoders[im.key] else encoders[im.key][0]
                    slots.append(base + held)
                    sources.append(torch.full_like(held, source))
                    rows.append(row_of[im.key][source] + positions[held] - im.start)
            cat = [torch.cat(x) if x else torch.empty(0, dtype=torch.int64) for x in (slots, sources, rows)]
            send_rows[dest].append(cat[2][cat[1] == me])
            if dest == me:
                requests.append((cat[0], cat[1]))
    return send_rows, requests


def _offsets(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return out
