"""From each rank's slice of the global batch to each rank's zigzag shards of its microbatches.

Every rank starts with the samples a Megatron data loader would give it (`local_slice`: with micro-batch
size 1, domain position i holds samples i, i+N, i+2N, ...). A step then

1. gathers every sample's id, length and loss-token count over the domain (`gather_batch`),
2. plans it on global rank 0 only and broadcasts the plan as JSON bytes (`broadcast_plan`),
3. checks that every rank holds the same plan for that batch
   (`check_plan`: one all-gather of the plan fingerprint; any difference or local rejection stops every
   rank with a `DhpError` instead of leaving some waiting in a later collective),
4. moves token ids, labels and loss mask with one `all_to_all_single` (uneven splits) so each rank holds
   exactly its zigzag shards, packed per microbatch as THD tensors (`move_tokens`).

These are the pieces; `engine.StepEngine` runs them in order for every entry point. A plan whose world
size differs from the domain is rejected (`check_world`) before any collective.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan, PlanError
from megatron_dhp.runtime.attention.comm import all_gather_single
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.fused import gather_rows, scatter_rows
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.workload.sample import Batch, Sample, VisualItem

if TYPE_CHECKING:
    from megatron_dhp.runtime.vision import VisionInputs


@dataclass(frozen=True)
class ImageInput:
    """One image (or video) of a sample: the run of LLM positions its embeddings fill, and its pixels."""

    start: int
    """First position of the sample it occupies; it fills `llm_tokens` positions from there."""
    llm_tokens: int
    enc_tokens: int
    """Vision-encoder tokens (patches) of all its tiles; each tile is one block of the encoder's attention."""
    pixels: torch.Tensor
    """[tiles, 3, height, width]."""

    @property
    def tiles(self) -> int:
        """Tiles (or frames): the encoder's independent attention blocks."""
        return int(self.pixels.shape[0])


@dataclass(frozen=True)
class TokenSample:
    """One training sequence as the data loader gives it: inputs, next-token labels, loss mask, all [L], and
    for a multimodal sample its images (their positions hold placeholder ids; the model fills them)."""

    id: int
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    """1 where the token's loss counts, 0 where it does not (e.g. prompt tokens); must be 0/1."""
    images: tuple[ImageInput, ...] = ()
    """By start position, non-overlapping."""

    def __post_init__(self) -> None:
        n = self.input_ids.numel()
        if n < 1 or self.input_ids.dim() != 1:
            raise DhpError(f"sample {self.id}: input_ids must be a non-empty 1-D tensor, got shape {tuple(self.input_ids.shape)}")
        for name in ("labels", "loss_mask"):
            shape = tuple(getattr(self, name).shape)
            if shape != (n,):
                raise DhpError(f"sample {self.id}: {name} has shape {shape}, expected ({n},) like input_ids")
        if not bool(((self.loss_mask == 0) | (self.loss_mask == 1)).all()):
            raise DhpError(f"sample {self.id}: loss_mask must hold only 0 and 1 (token weights are not supported)")
        end = 0
        for k, image in enumerate(self.images):
            if image.start < end or image.llm_tokens < 1 or image.start + image.llm_tokens > n:
                raise DhpError(f"sample {self.id}: image {k} at positions {image.start}..{image.start + image.llm_tokens - 1} "
                               f"must lie inside the sample's {n} tokens, after the previous image, in start order")
            if image.pixels.dim() != 4 or image.tiles < 1 or image.enc_tokens % image.tiles:
                raise DhpError(f"sample {self.id}: image {k} needs pixels [tiles >= 1, 3, h, w] and encoder tokens that "
                               f"divide by its tiles, got {tuple(image.pixels.shape)} and {image.enc_tokens}")
            end = image.start + image.llm_tokens

    @property
    def length(self) -> int:
        """L: the sample's token count."""
        return self.input_ids.numel()


def local_slice(samples: Sequence[TokenSample], position: int, size: int) -> list[TokenSample]:
    """The samples domain position `position` of `size` starts with: every size-th one (Megatron, mbs 1)."""
    return list(samples[position::size])


@dataclass(frozen=True)
class GatheredImage:
    """An image of the global batch as every rank knows it after the gather (its pixels stay with `owner`)."""

    sample_id: int
    index: int
    """Its place among the sample's images."""
    start: int
    llm_tokens: int
    enc_tokens: int
    tiles: int
    tile_shape: tuple[int, int, int]
    """[channels, height, width] of each tile."""
    owner: int
    """Domain position that holds its pixels (the sample's)."""

    @property
    def key(self) -> tuple[int, int]:
        """(sample id, index): the canonical order of the batch's images."""
        return self.sample_id, self.index


@dataclass(frozen=True)
class GatheredBatch:
    """What every rank knows after the length gather: the global batch and who holds which sample."""

    batch: Batch
    owners: dict[int, int]
    """Sample id -> domain position that holds its tokens."""
    num_loss_tokens: int
    """Tokens whose loss counts, over the whole global batch: the step's loss denominator."""
    images: tuple[GatheredImage, ...] = ()
    """Every image of the batch, by (sample id, index)."""


SlotRows = tuple[tuple[int, ...], ...]
"""Local rows of the k-th slot of each phase, `rows[phase][k]`, the same on every rank of the domain."""


@dataclass(frozen=True)
class MicrobatchInputs:
    """One microbatch as this rank runs it: its group, its THD layout and its shards, all [t]."""

    group_ranks: tuple[int, ...]
    """The group's domain positions, sorted (group rank r is the r-th of them)."""
    phase: int
    layout: MicrobatchLayout
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    """True position of every slot in its sample (padding slots continue past the end)."""


@dataclass(frozen=True)
class StepInputs:
    """This rank's share of one step."""

    plan: Plan
    microbatches: tuple[MicrobatchInputs, ...]
    """In execution order: by phase, then microbatch order within the group."""
    num_loss_tokens: int
    num_tokens: int
    """Real tokens of the global batch."""
    seq_multiple: int = 1
    """Every sample's shard is padded to a multiple of this (the TP size under sequence parallelism)."""
    slot_rows: SlotRows | None = None
    """Rows every rank holds in each aligned slot when the step equalises them (`slots.aligned_slot_rows`)."""
    vision: VisionInputs | None = None
    """The step's images on this rank (`vision.move_images`), when the batch has any."""


def gather_batch(local: Sequence[TokenSample], domain: DynamicDomain) -> GatheredBatch:
    """All-gather (id, length, loss tokens) of every sample over the domain, then, when the batch has images,
    (sample id, index, start, LLM tokens, encoder tokens, pixel shape) of every image. Collective."""
    rows = [[s.id, s.length, int(s.loss_mask.sum()), len(s.images)] for s in local]
    owners: dict[int, int] = {}
    lengths: dict[int, int] = {}
    loss_tokens, num_images = 0, 0
    for position, held in enumerate(_gather_rows(rows, 4, domain)):
        for sid, length, n_loss, n_images in held:
            if sid in owners:
                raise DhpError(f"sample id {sid} is held by domain positions {owners[sid]} and {position}; ids must be unique")
            owners[sid], lengths[sid] = position, length
            loss_tokens += n_loss
            num_images += n_images
    if not owners:
        raise DhpError("no rank of the domain holds a sample; the global batch is empty")
    if loss_tokens == 0:
        raise DhpError("no token of the global batch has loss_mask 1; the step would divide by zero tokens")
    images: list[GatheredImage] = []
    if num_images:  # every rank knows the count, so all of them take this second gather or none does
        mine = [[s.id, k, im.start, im.llm_tokens, im.enc_tokens, *im.pixels.shape]
                for s in local for k, im in enumerate(s.images)]
        images = sorted((GatheredImage(*row[:6], tile_shape=tuple(row[6:]), owner=position)
                         for position, held in enumerate(_gather_rows(mine, 9, domain)) for row in held),
                        key=lambda im: im.key)
        if len({im.tile_shape for im in images}) > 1:
            raise DhpError(f"the batch's images have tiles of shapes {sorted({im.tile_shape for im in images})}; every "
                           "tile must have the model's one shape [3, tile_px, tile_px]")
    # The planner sees each image as the encoder will run it: its encoder and LLM tokens, one block per tile.
    items: dict[int, list[VisualItem]] = {}
    for im in images:
        items.setdefault(im.sample_id, []).append(VisualItem(im.enc_tokens, im.llm_tokens, (im.enc_tokens // im.tiles,) * im.tiles))
    samples = [Sample(sid, lengths[sid], tuple(items.get(sid, ()))) for sid in sorted(lengths)]
    return GatheredBatch(Batch(tuple(samples)), owners, loss_tokens, tuple(images))


def _gather_rows(rows: list[list[int]], width: int, domain: DynamicDomain) -> list[list[list[int]]]:
    """Every domain position's rows of `width` integers (any count per position). Two all-gathers."""
    mine = torch.tensor(rows, dtype=torch.int64).view(-1, width)
    counts = _all_gather(torch.tensor([mine.shape[0]]), domain.group, domain.size, domain.device).view(-1).tolist()
    padded = torch.zeros(max(max(counts), 1), width, dtype=torch.int64)
    padded[: mine.shape[0]] = mine
    gathered = _all_gather(padded, domain.group, domain.size, domain.device).view(domain.size, -1, width)
    return [gathered[position, :count].tolist() for position, count in enumerate(counts)]


def check_world(plan: Plan, domain: DynamicDomain) -> None:
    """Reject a plan made for another domain size. Local: call it before any collective of the step."""
    if plan.world_size != domain.size:
        raise DhpError(
            f"the plan is for a domain of {plan.world_size} ranks but this domain has {domain.size} "
            "(DP x CP ranks per TP/PP coordinate); plan with world_size = " + str(domain.size)
        )


def check_plan(plan: Plan, gathered: GatheredBatch, domain: DynamicDomain) -> None:
    """Stop every rank unless all ranks hold the same valid plan for the gathered batch. Collective.

    The check spans the whole world, not only this domain: every domain (TP/PP coordinate) executes the
    same plan and group creation is world-collective, so a domain with another plan would hang the others.
    Local problems (a plan that breaks an invariant or does not match the batch) travel in the same
    all-gather as the fingerprint, so a rank never waits for a peer that has already given up.
    """
    problem = _local_problem(plan, gathered)
    fingerprint = plan.fingerprint()
    mine = torch.tensor([_signed64(fingerprint), int(problem is not None)], dtype=torch.int64)
    world = dist.get_world_size()
    table = _all_gather(mine, None, world, domain.device).view(world, 2).tolist()
    me = dist.get_rank()
    if problem is not None:
        raise DhpError(f"rank {me} (domain position {domain.position}) rejects the plan: {problem}")
    rejecting = [r for r, (_, bad) in enumerate(table) if bad]
    if rejecting:
        raise DhpError(f"ranks {rejecting} rejected the plan (see their errors); every rank stops")
    differing = [r for r, (fp, _) in enumerate(table) if fp != table[me][0]]
    if differing:
        theirs = format(table[differing[0]][0] % (1 << 64), "016x")
        raise DhpError(
            f"ranks hold different plans: rank {me} has fingerprint {fingerprint}, ranks {differing} have "
            f"{theirs} (first shown); every rank must be given the same plan"
        )


PLANNING_RANK = 0
"""The global rank that solves every planned step; the others receive its plan (`broadcast_plan`)."""


def broadcast_plan(solve: Callable[[], Plan], domain: DynamicDomain) -> Plan:
    """The plan `solve` returns on global rank `PLANNING_RANK`, held by every rank of the world. Collective.

    Only that rank solves, so a planner that is not deterministic across ranks (a MILP under a time limit,
    any planner a user registers) still gives one plan per step, and a slow one costs one rank's CPU, not
    every rank's. The plan travels as its JSON (plain data, never a pickle); an error `solve` raises travels
    instead, so the other ranks stop with it rather than wait for a plan that will not come. Every rank, the
    solving one included, returns the plan parsed from the same bytes, so all hold equal `Plan`s.
    """
    if dist.get_rank() == PLANNING_RANK:
        try:
            plan = solve()
        except Exception as e:
            _broadcast_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(), domain)
            raise
        message = json.loads(_broadcast_bytes(json.dumps({"plan": plan.to_dict()}, separators=(",", ":")).encode(), domain))
    else:
        message = json.loads(_broadcast_bytes(None, domain))
    if "error" in message:
        raise DhpError(f"rank {PLANNING_RANK} could not plan the step: {message['error']}")
    return Plan.from_dict(message["plan"])


def move_tokens(local: Sequence[TokenSample], plan: Plan, gathered: GatheredBatch, domain: DynamicDomain, *,
                seq_multiple: int = 1, slot_rows: SlotRows | None = None) -> StepInputs:
    """Send every token to the rank that computes it and pack this rank's microbatches (each sample's shard
    padded to a multiple of `seq_multiple`, see `layout`; the k-th microbatch of a phase padded further to
    `slot_rows[phase][k]` rows when given). Collective."""
    me = domain.position
    lengths = {s.id: s.tokens for s in gathered.batch.samples}
    # this rank's samples back to back, one row (input id, label, loss mask) per token
    fields = [torch.stack([t.to(torch.int64) for t in (s.input_ids, s.labels, s.loss_mask)], 1) for s in local]
    rows = torch.cat([torch.empty(0, 3, dtype=torch.int64), *fields])
    first_row = dict(zip((s.id for s in local), itertools.accumulate((s.length for s in local), initial=0)))

    # the send buffer is one gather: per destination, the real rows of each shard it computes from here
    picks, send_rows = [torch.empty(0, dtype=torch.int64)], []
    for dest in range(domain.size):
        count = 0
        for layout, _, _ in microbatches_of(plan, dest, lengths, seq_multiple, slot_rows):
            for i, (sid, n) in enumerate(zip(layout.sample_ids, layout.lengths)):
                if gathered.owners[sid] == me:
                    held = layout.sample_positions(i)
                    picks.append(first_row[sid] + held[held < n])
                    count += picks[-1].numel()
        send_rows.append(count)
    send = gather_rows(rows, torch.cat(picks))

    mine = microbatches_of(plan, me, lengths, seq_multiple, slot_rows)
    owner_of_sample = [gathered.owners[sid] for layout, _, _ in mine for sid in layout.sample_ids]
    slots_of_sample = [n for layout, _, _ in mine for n in layout.local_lengths]
    sources = torch.repeat_interleave(
        torch.tensor(owner_of_sample, dtype=torch.int64), torch.tensor(slots_of_sample, dtype=torch.int64)
    )
    real = torch.cat([layout.real() for layout, _, _ in mine] or [torch.empty(0, dtype=torch.bool)])
    recv_counts = torch.bincount(sources[real], minlength=domain.size).tolist()
    received = all_to_all_rows(send, send_rows, recv_counts, domain).cpu()

    # received rows come grouped by source rank, each group in this rank's slot order; padding slots stay 0
    real_slots = torch.nonzero(real).view(-1)
    order = torch.argsort(sources[real], stable=True)
    slots = scatter_rows(received, real_slots[order], real.numel())
    return StepInputs(
        plan=plan,
        microbatches=tuple(_pack(mine, slots)),
        num_loss_tokens=gathered.num_loss_tokens,
        num_tokens=gathered.batch.num_tokens,
        seq_multiple=seq_multiple,
        slot_rows=slot_rows,
    )


def _local_problem(plan: Plan, gathered: GatheredBatch) -> str | None:
    try:
        plan.validate()
    except PlanError as e:
        return str(e)
    planned = {s.id: s.tokens for s in plan.samples}
    actual = {s.id: s.tokens for s in gathered.batch.samples}
    for sid, n in actual.items():
        if planned.get(sid) != n:
            return f"sample {sid} has {n} tokens but the plan says {planned.get(sid)}; plan the gathered batch"
    extra = sorted(set(planned) - set(actual))
    if extra:
        return f"the plan lists sample {extra[0]}, which no rank holds"
    return None


def microbatches_of(plan: Plan, position: int, lengths: dict[int, int], seq_multiple: int,
                     slot_rows: SlotRows | None) -> list[tuple[MicrobatchLayout, tuple[int, ...], int]]:
    """(layout, sorted group ranks, phase) of every microbatch `position` runs, in execution order."""
    out = []
    for group in plan.groups_of_rank(position):
        ranks = tuple(sorted(group.ranks))
        for k, mb in enumerate(group.microbatches):
            layout = MicrobatchLayout(
                sample_ids=mb, lengths=tuple(lengths[s] for s in mb), group_size=len(ranks), rank=ranks.index(position),
                seq_multiple=seq_multiple,
            )
            if slot_rows is not None:  # a rank's k-th microbatch of a phase is its k-th slot of it
                layout = layout.with_rows(slot_rows[group.phase][k])
            out.append((layout, ranks, group.phase))
    return out


def _pack(mine: list[tuple[MicrobatchLayout, tuple[int, ...], int]], slots: torch.Tensor) -> list[MicrobatchInputs]:
    out, start = [], 0
    for layout, ranks, phase in mine:
        block = slots[start : start + layout.num_slots]
        start += layout.num_slots
        out.append(
            MicrobatchInputs(
                group_ranks=ranks,
                phase=phase,
                layout=layout,
                input_ids=block[:, 0].contiguous(),
                labels=block[:, 1].contiguous(),
                loss_mask=block[:, 2].to(torch.float32),
                position_ids=layout.local_positions,
            )
        )
    return out


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, device: torch.device) -> torch.Tensor:
    x = x.to(device)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out.cpu()


def all_to_all_rows(send: torch.Tensor, send_rows: list[int], recv_rows: list[int], domain: DynamicDomain) -> torch.Tensor:
    """One all-to-all over the domain: `send_rows[d]` rows of `send` (rows of any equal shape) to position d,
    in order; `recv_rows[s]` rows from each source s, grouped by source, on the domain's device. Collective."""
    tail = send.shape[1:]
    width = int(tail.numel())
    device = domain.device
    out = torch.empty(sum(recv_rows) * width, dtype=send.dtype, device=device)
    dist.all_to_all_single(
        out, send.reshape(-1).to(device), [n * width for n in recv_rows], [n * width for n in send_rows], group=domain.group
    )
    return out.view(-1, *tail)


def _broadcast_bytes(data: bytes | None, domain: DynamicDomain) -> bytes:
    """`data` of rank `PLANNING_RANK` on every rank of the world (None elsewhere): its length, then its bytes."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=domain.device)
    _broadcast(size, domain)
    if data is None:
        buffer = torch.empty(int(size), dtype=torch.uint8, device=domain.device)
    else:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(domain.device)
    _broadcast(buffer, domain)
    return buffer.cpu().numpy().tobytes()


def _broadcast(x: torch.Tensor, domain: DynamicDomain) -> None:
    """Broadcast from `PLANNING_RANK` over the world, waiting at most the domain's timeout: the other ranks
    wait here while it solves, so a planner slower than the timeout stops them with a message saying so."""
    try:
        dist.broadcast(x, src=PLANNING_RANK, async_op=True).wait(timeout=domain.timeout)
    except RuntimeError as e:
        raise DhpError(
            f"rank {dist.get_rank()} got no plan from rank {PLANNING_RANK} ({e}): rank {PLANNING_RANK} stopped (see "
            f"its error), or its planner took longer than the collective timeout of "
            f"{domain.timeout.total_seconds():.0f} s (raise train.timeout_s, Megatron's --distributed-timeout-minutes)"
        ) from e


def _signed64(hex_digest: str) -> int:
    value = int(hex_digest, 16)
    return value - (1 << 64) if value >= 1 << 63 else value
