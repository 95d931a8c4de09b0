"""Pipeline slots: the microbatch list each domain position runs under pipeline parallelism (PP = P > 1).

Every (TP, PP) coordinate's domain applies the same plan, so a dynamic group is one pipeline and each domain
position runs megatron-core's non-interleaved 1F1B over its own list of *slots*, laid out phase by phase:
in every phase but the last, every position runs k_q = (the most microbatches any position has in phase q)
slots and fills the ones it has no microbatch for with idle slots (a one-token, zero-loss microbatch on a
group of one); the last phase is not padded. A group of phase p therefore runs its microbatch j at slot
o_p + j on every member, o_p = sum_{q<p} k_q, so all members meet each of its collectives at the same 1F1B
step (deadlock-free by construction; docs/cost-model.md). Stage s keeps up to min(P - s, K) microbatches in
flight, so the per-rank token cap must hold over any P consecutive slots of a position.

Interleaved pipelining (V > 1 virtual stages, each stage holding V model chunks of L / (P V) layers) runs
megatron-core's interleaved 1F1B instead, whose order depends on the slot count K itself: every position
runs the same K (the last phase padded too), rounded up to a multiple of P (megatron-core 0.16's rule for
its default microbatch group of P). Its ops follow `schedule_order`; a chunk in flight holds 1 / V of a
microbatch's activations on its stage, and stage 0 keeps `in_flight_chunks(P, V)` chunks in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from megatron_dhp.plan.memory import Footprint
    from megatron_dhp.plan.plan import Plan


def interleaving_problem(stages: int, virtual: int, names: tuple[str, str] = ("pipeline_stages", "virtual_stages"),
                         ) -> str | None:
    """What is wrong with `virtual` model chunks per stage at `stages` pipeline stages (None: nothing), in the
    caller's words for the two (`names`: flags such as ("--pp", "--vpp"), or config keys): every entry point's
    one rule, at least one chunk, and more than one only across two stages or more."""
    stage_name, virtual_name = names

    def said(name: str, value: int) -> str:
        return f"{name} {value}" if name.startswith("--") else f"{name} = {value}"

    if virtual < 1:
        return f"{said(virtual_name, virtual)} must be at least 1"
    if virtual > 1 and stages < 2:
        return (f"{said(virtual_name, virtual)} interleaves model chunks of a pipeline: it needs {stage_name} >= 2 "
                f"(got {said(stage_name, stages)})")
    return None


def pipeline_token_cap(max_tokens_per_rank: int, stages: int, virtual: int = 1) -> int:
    """Tokens per rank one microbatch may hold at `stages` pipeline stages of `virtual` chunks: M // P, so that
    the P microbatches stage 0 keeps in flight under 1F1B hold at most M per rank (M itself without
    pipelining); interleaved, M V // C for the C = `in_flight_chunks` chunks of 1 / V each."""
    return max_tokens_per_rank * virtual // in_flight_chunks(stages, virtual)


def in_flight_chunks(stages: int, virtual: int = 1) -> int:
    """The most model chunks stage 0 keeps in flight: its warm-up forwards and the one of 1F1B's step."""
    return warmup_ops(0, stages, virtual) + 1


def warmup_ops(stage: int, stages: int, virtual: int = 1) -> int:
    """Forwards `stage` runs before its first backward, unbounded by the slot count (megatron-core's
    `get_pp_rank_microbatches`): P - s - 1, interleaved 2 (P - s - 1) + (V - 1) P."""
    if virtual == 1:
        return stages - stage - 1
    return 2 * (stages - stage - 1) + (virtual - 1) * stages


def chunk_table(num_slots: int, stages: int, virtual: int) -> list[tuple[int, int]]:
    """(slot, chunk) of each forward in interleaved order (megatron-core's schedule table with its default
    microbatch group of P): slots in groups of P (the last group takes the rest), each group through chunk 0,
    then chunk 1, ...; the backward of the same index runs chunk V - 1 - chunk of the same slot."""
    table = []
    for first in range(0, num_slots, stages):
        last = num_slots if first + stages >= num_slots else first + stages
        table += [(j, c) for c in range(virtual) for j in range(first, last)]
    return table


def schedule_order(num_slots: int, stage: int, stages: int, virtual: int = 1) -> list[tuple[int, int]]:
    """One stage's ops in megatron-core's (interleaved) 1F1B order: (0 forward / 1 backward, index into
    `chunk_table`; at V = 1 the slot itself)."""
    total = num_slots * virtual
    warmup = min(warmup_ops(stage, stages, virtual), total)
    order = [(0, k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [(0, warmup + i), (1, i)]
    return order + [(1, k) for k in range(total - warmup, total)]


def padded_slot_count(longest: int, stages: int) -> int:
    """The slots every position runs interleaved: the longest list, at least one, up to a multiple of P."""
    return -(-max(longest, 1) // stages) * stages


class SlotRef(NamedTuple):
    """One real microbatch of a position's slot list: `plan.groups[group].microbatches[microbatch]`."""

    group: int
    microbatch: int


def pipeline_slots(plan: Plan) -> list[list[SlotRef | None]]:
    """Each domain position's slots, in slot order; None is an idle slot (every phase but the last padded to
    the same offset on all positions; interleaved, the end too, to `padded_slot_count`)."""
    groups_by_phase: list[list[int]] = [[] for _ in range(plan.num_phases)]
    for gi, g in enumerate(plan.groups):
        groups_by_phase[g.phase].append(gi)
    slots: list[list[SlotRef | None]] = [[] for _ in range(plan.world_size)]
    offset, last = 0, plan.num_phases - 1
    for phase, members in enumerate(groups_by_phase):
        for gi in members:
            g = plan.groups[gi]
            for r in g.ranks:
                slots[r] += [SlotRef(gi, j) for j in range(len(g.microbatches))]
        if phase < last:
            offset += max((len(plan.groups[gi].microbatches) for gi in members), default=0)
            for row in slots:
                row += [None] * (offset - len(row))
    if plan.virtual_stages > 1:
        end = padded_slot_count(max(map(len, slots)), plan.pipeline_stages)
        for row in slots:
            row += [None] * (end - len(row))
    return slots


def in_flight_peak(per_slot: list[float], stages: int, virtual: int = 1) -> tuple[float, int, int]:
    """The most of `per_slot` (tokens per rank of each slot) stage 0 holds at once under the schedule, in
    microbatch equivalents (a chunk holds 1 / V), and the first and last slot in flight at that moment.

    Stage 0 runs its forwards in `chunk_table` order and its backwards in the same order, one backward after
    each forward past its warm-up, so what it holds at any moment is a window of C = `in_flight_chunks`
    consecutive table entries (at V = 1: C = P consecutive slots)."""
    table = [(j, 0) for j in range(len(per_slot))] if virtual == 1 else chunk_table(len(per_slot), stages, virtual)
    width = min(in_flight_chunks(stages, virtual), len(table))
    best, at = -1.0, 0
    for first in range(len(table) - width + 1):
        window = sum(per_slot[j] for j, _ in table[first : first + width]) / virtual
        if window > best:
            best, at = window, first
    slots_in = [j for j, _ in table[at : at + width]]
    return best, min(slots_in, default=0), max(slots_in, default=0)


def slot_tokens_per_rank(plan: Plan, slots: list[SlotRef | None], footprint: Footprint) -> list[float]:
    """Tokens per rank of each slot of one position under the plan's `footprint` (an idle slot's single
    token is not counted: the cap is for the microbatches a plan places)."""
    out = []
    for slot in slots:
        if slot is None:
            out.append(0.0)
        else:
            g = plan.groups[slot.group]
            out.append(footprint.per_rank(plan.positions(g.microbatches[slot.microbatch]), g.size, g.shares))
    return out
