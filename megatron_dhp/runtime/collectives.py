"""The step's collectives over the domain (and the world) that are not attention: what every rank must agree
on before any token moves, and the one all-to-all that moves rows.

A step

1. gathers every sample's id, length and loss-token count over the domain (`gather_batch`),
2. plans it on global rank 0 only and broadcasts the plan as JSON bytes (`broadcast_plan`),
3. checks that every rank holds the same plan for that batch
   (`check_plan`: one all-gather of the plan fingerprint; any difference or local rejection stops every
   rank with a `DhpError` instead of leaving some waiting in a later collective),

then moves its tokens (`dispatch.move_tokens`) and images (`vision.move_images`) with `all_to_all_rows`.
`engine.StepEngine` runs them in order for every entry point. A plan whose world size differs from the
domain is rejected (`check_world`) before any collective. All of them but the image move are read on the host,
so they run on the domain's control plane (`DynamicDomain.control_plane`: gloo beside an NCCL job), where a
result read on the host never waits for the GPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan, PlanError
from megatron_dhp.runtime.attention.comm import all_gather_single
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.step_data import GatheredBatch, GatheredImage, TokenSample
from megatron_dhp.workload.sample import Batch, Sample, VisualItem


def gather_batch(local: Sequence[TokenSample], domain: DynamicDomain, report: Sequence[float] = (), *,
                 width: int = 0) -> GatheredBatch:
    """All-gather (id, length, loss tokens) of every sample over the domain, with this rank's `report` (at
    most `width` floats, the same on every rank, NaN-padded: the closed loop's measurement, so it needs no
    collective of its own), then, when the batch has images, (sample id, index, start, LLM tokens, encoder
    tokens, pixel shape) of every image. Collective."""
    if len(report) > width:
        raise DhpError(f"a rank's report holds at most {width} floats, not {len(report)}")
    rows = [[s.id, s.length, int(s.loss_mask.sum()), len(s.images)] for s in local]
    owners: dict[int, int] = {}
    lengths: dict[int, int] = {}
    loss_tokens, num_images = 0, 0
    held_rows, reports = _gather_rows(rows, 4, domain, report, width)
    for position, held in enumerate(held_rows):
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
                         for position, held in enumerate(_gather_rows(mine, 9, domain)[0]) for row in held),
                        key=lambda im: im.key)
        if len({im.tile_shape for im in images}) > 1:
            raise DhpError(f"the batch's images have tiles of shapes {sorted({im.tile_shape for im in images})}; every "
                           "tile must have the model's one shape [3, tile_px, tile_px]")
    # The planner sees each image as the encoder will run it: its encoder and LLM tokens, one block per tile.
    items: dict[int, list[VisualItem]] = {}
    for im in images:
        items.setdefault(im.sample_id, []).append(VisualItem(im.enc_tokens, im.llm_tokens, (im.enc_tokens // im.tiles,) * im.tiles))
    samples = [Sample(sid, lengths[sid], tuple(items.get(sid, ()))) for sid in sorted(lengths)]
    return GatheredBatch(Batch(tuple(samples)), owners, loss_tokens, tuple(images), reports)


def _gather_rows(rows: list[list[int]], width: int, domain: DynamicDomain, report: Sequence[float] = (),
                 report_width: int = 0) -> tuple[list[list[list[int]]], tuple[tuple[float, ...], ...]]:
    """Every domain position's rows of `width` integers (any count per position), and its report (NaN-padded
    to `report_width`) riding with the row count. Two all-gathers."""
    mine = torch.tensor(rows, dtype=torch.int64).view(-1, width)
    head = torch.full((1 + report_width,), float("nan"), dtype=torch.float64)
    head[0] = mine.shape[0]
    head[1 : 1 + len(report)] = torch.tensor(list(report), dtype=torch.float64)
    group, device = domain.control_plane()
    heads = _all_gather(head, group, domain.size, device).view(domain.size, -1)
    counts = [int(c) for c in heads[:, 0].tolist()]
    padded = torch.zeros(max(max(counts), 1), width, dtype=torch.int64)
    padded[: mine.shape[0]] = mine
    gathered = _all_gather(padded, group, domain.size, device).view(domain.size, -1, width)
    reports = tuple(tuple(row) for row in heads[:, 1:].tolist())
    return [gathered[position, :count].tolist() for position, count in enumerate(counts)], reports


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
    group, device = domain.control_plane(world=True)
    table = _all_gather(mine, group, world, device).view(world, 2).tolist()
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


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, device: torch.device) -> torch.Tensor:
    x = x.to(device)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out.cpu()


def all_to_all_rows(send: torch.Tensor, send_rows: list[int], recv_rows: list[int], domain: DynamicDomain, *,
                    on_host: bool = False) -> torch.Tensor:
    """One all-to-all over the domain: `send_rows[d]` rows of `send` (rows of any equal shape) to position d,
    in order; `recv_rows[s]` rows from each source s, grouped by source, on the domain's device (`on_host`: on
    the control plane, `DynamicDomain.control_plane`, for rows the host reads). Collective."""
    tail = send.shape[1:]
    width = int(tail.numel())
    group, device = domain.control_plane() if on_host else (domain.group, domain.device)
    out = torch.empty(sum(recv_rows) * width, dtype=send.dtype, device=device)
    dist.all_to_all_single(
        out, send.reshape(-1).to(device), [n * width for n in recv_rows], [n * width for n in send_rows], group=group
    )
    return out.view(-1, *tail)


def _broadcast_bytes(data: bytes | None, domain: DynamicDomain) -> bytes:
    """`data` of rank `PLANNING_RANK` on every rank of the world (None elsewhere): its length, then its bytes."""
    device = domain.control_plane(world=True)[1]
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    _broadcast(size, domain)
    if data is None:
        buffer = torch.empty(int(size), dtype=torch.uint8, device=device)
    else:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    _broadcast(buffer, domain)
    return buffer.cpu().numpy().tobytes()


def _broadcast(x: torch.Tensor, domain: DynamicDomain) -> None:
    """Broadcast from `PLANNING_RANK` over the world, waiting at most the domain's timeout: the other ranks
    wait here while it solves, so a planner slower than the timeout stops them with a message saying so."""
    try:
        group = domain.control_plane(world=True)[0]
        dist.broadcast(x, src=PLANNING_RANK, group=group, async_op=True).wait(timeout=domain.timeout)
    except RuntimeError as e:
        raise DhpError(
            f"rank {dist.get_rank()} got no plan from rank {PLANNING_RANK} ({e}): rank {PLANNING_RANK} stopped (see "
            f"its error), or its planner took longer than the collective timeout of "
            f"{domain.timeout.total_seconds():.0f} s (raise train.timeout_s, Megatron's --distributed-timeout-minutes)"
        ) from e


def _signed64(hex_digest: str) -> int:
    value = int(hex_digest, 16)
    return value - (1 << 64) if value >= 1 << 63 else value
