"""The plan of one step: which ranks form which groups, and which samples each group runs.

A plan is plain data with a JSON form (`megatron-dhp/plan/v1`, docs/plan-format.md). Planners
produce it, the cost model scores it and the runtime executes it; none of them needs another's internals.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dhp.config_io import load_json_file
from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.files import PLAN_BYTES
from megatron_dhp.plan.memory import Footprint, MemoryRule
from megatron_dhp.plan.pipeline import (
    in_flight_peak,
    interleaving_problem,
    pipeline_slots,
    slot_tokens_per_rank,
)
from megatron_dhp.plan.rank_speeds import (
    rank_speeds_text,  # noqa: F401 - the train loop's step line imports it here
    slow_ranks,
    slow_ranks_text,
)
from megatron_dhp.plan.shares import normalize_shares
from megatron_dhp.workload.sample import Sample

SCHEMA = "megatron-dhp/plan/v1"
SUMMARY_SLOW = 4
"""The summary line names at most this many slow ranks."""


class PlanError(DhpError):
    """A plan that breaks an invariant (every sample once, every rank placed, memory cap)."""


def memory_fields(rule: MemoryRule) -> dict[str, object]:
    """A plan's fields that record `rule` (its cap aside): what `Plan.memory_rule` reads back."""
    return {"encoder_placement": rule.placement, "enc_memory_per_token": rule.enc_memory_per_token,
            "kv_memory_per_token": rule.kv_memory_per_token}


@dataclass(frozen=True)
class PlanGroup:
    """A set of ranks that runs its microbatches as context parallelism over exactly those ranks.

    `ranks` are positions 0..world_size-1 inside the dynamic domain. Each microbatch is a tuple of sample
    ids processed together as one packed (THD) sequence set; a group without microbatches has no work
    this step (its ranks only join the gradient reduction). A group of phase k starts once all its ranks
    have finished their groups of earlier phases.
    """

    ranks: tuple[int, ...]
    microbatches: tuple[tuple[int, ...], ...]
    phase: int = 0
    shares: tuple[int, ...] = ()
    """Each rank's part of every sample, in the order of `ranks` (`plan.shares`); empty: even shards. Equal
    shares are stored as empty, so a plan has one form."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(map(int, self.ranks)))
        object.__setattr__(self, "microbatches", tuple(tuple(map(int, mb)) for mb in self.microbatches))
        object.__setattr__(self, "phase", int(self.phase))
        try:
            object.__setattr__(self, "shares", normalize_shares(self.shares, len(self.ranks)))
        except ValueError as e:
            raise PlanError(f"group of ranks {list(self.ranks)}: {e}") from None

    @classmethod
    def of_normal_form(cls, ranks: tuple[int, ...], microbatches: tuple[tuple[int, ...], ...], phase: int,
                       shares: tuple[int, ...]) -> PlanGroup:
        """A group from fields already in the form `__post_init__` gives them (tuples of Python ints, shares
        as `normalize_shares` returns them), without its copies: dhp builds a thousand groups a step at 1,024
        ranks, in 2.4 ms and 9 garbage-collector passes this way against 8.0 ms and 15 through them."""
        group = object.__new__(cls)
        for name, value in (("ranks", ranks), ("microbatches", microbatches), ("phase", phase), ("shares", shares)):
            object.__setattr__(group, name, value)
        return group

    @property
    def size(self) -> int:
        """Ranks in the group (its context-parallel degree)."""
        return len(self.ranks)

    @property
    def sample_ids(self) -> list[int]:
        """Every sample id of the group, microbatch by microbatch."""
        return [i for mb in self.microbatches for i in mb]

    @property
    def sorted_shares(self) -> tuple[int, ...]:
        """`shares` in the order of the sorted ranks (a rank's place in its group), empty when even."""
        return tuple(w for _, w in sorted(zip(self.ranks, self.shares)))

    def to_dict(self) -> dict:
        """The plan-JSON form of the group (`shares` only where uneven)."""
        out = {"phase": self.phase, "ranks": list(self.ranks), "microbatches": [list(mb) for mb in self.microbatches]}
        if self.shares:
            out["shares"] = list(self.shares)
        return out


@dataclass(frozen=True)
class Plan:
    """A validated-on-demand step plan; see `validate` for the invariants it must hold."""

    planner: str
    world_size: int
    gpus_per_node: int
    samples: tuple[Sample, ...]
    groups: tuple[PlanGroup, ...]
    max_tokens_per_rank: int | None = None
    phase_barrier: bool = False
    """Whether every rank waits for all ranks between phases (megatron-hcp's schedule does; under pipeline
    parallelism the slot layout already orders the phases and no barrier runs)."""
    pipeline_stages: int = 1
    """P: pipeline-parallel stages; P > 1 runs each position's microbatches as 1F1B slots (`pipeline_slots`)."""
    virtual_stages: int = 1
    """V: model chunks per stage; V > 1 runs the slots under megatron-core's interleaved 1F1B."""
    encoder_placement: str = "split"
    """Where the vision encoder runs this step (split, replicate or global: `cost.encoder`), the placement
    the plan was priced with; the runtime runs it so."""
    enc_memory_per_token: float = 0.0
    """w: an encoder token's activations in LLM tokens, which count against the cap (`plan.memory`)."""
    kv_memory_per_token: float = 0.0
    """g: a token's keys and values, which every rank of an all-gather group keeps, in tokens (`plan.memory`)."""
    rank_speeds: tuple[float, ...] = ()
    """Each position's relative speed the plan was priced with (empty: all 1); recorded, not executed."""
    predicted_step_time_s: float | None = None
    lower_bound_s: float | None = None
    solve_time_ms: float | None = None
    _by_id: dict[int, Sample] = field(init=False, repr=False, compare=False)
    _position: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "rank_speeds", tuple(float(v) for v in self.rank_speeds))
        object.__setattr__(self, "_by_id", {s.id: s for s in self.samples})
        object.__setattr__(self, "_position", {s.id: k for k, s in enumerate(self.samples)})

    # ------------------------------------------------------------------ queries
    def sample(self, sample_id: int) -> Sample:
        """The sample with this id."""
        return self._by_id[sample_id]

    def positions(self, sample_ids: Sequence[int]) -> list[int]:
        """Where these samples sit in `samples` (the index a `Footprint` of them takes)."""
        return [self._position[i] for i in sample_ids]

    @property
    def num_phases(self) -> int:
        """How many times the step re-forms its groups (1 + the highest phase)."""
        return 1 + max((g.phase for g in self.groups), default=0)

    @property
    def num_microbatches(self) -> int:
        """Microbatches over all groups."""
        return sum(len(g.microbatches) for g in self.groups)

    def multi_rank_groups(self) -> tuple[tuple[int, ...], ...]:
        """The distinct rank sets of more than one rank, sorted, in plan order: each needs a communicator (or a
        ring on the domain's)."""
        return tuple(dict.fromkeys(tuple(sorted(g.ranks)) for g in self.groups if g.size > 1))

    def groups_of_rank(self, rank: int) -> list[PlanGroup]:
        """The groups `rank` belongs to, in execution (phase) order."""
        return sorted((g for g in self.groups if rank in g.ranks), key=lambda g: g.phase)

    def summary(self) -> str:
        """One line: group sizes as `countxsize`, phases, microbatches, groups with uneven shares, slow ranks,
        predicted time against the bound."""
        sizes = Counter(g.size for g in self.groups)
        parts = [f"groups {' '.join(f'{n}x{d}' for d, n in sorted(sizes.items()))}"]
        if self.pipeline_stages > 1:
            parts.append(f"pp {self.pipeline_stages}" + (f" x vpp {self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.num_phases > 1:
            parts.append(f"{self.num_phases} phases")
        if self.encoder_placement != "split":
            parts.append(f"encoder {self.encoder_placement}")
        parts.append(f"{self.num_microbatches} mb")
        uneven = sum(1 for g in self.groups if g.shares)
        if uneven:
            parts.append(f"{uneven} uneven")
        slow = slow_ranks_text(self.rank_speeds, most=SUMMARY_SLOW)
        if slow:
            parts.append(slow)
        if self.predicted_step_time_s is not None:
            pred = f"pred {self.predicted_step_time_s:.3f}s"
            if self.lower_bound_s:
                pred += f" ({self.predicted_step_time_s / self.lower_bound_s:.3f}x LB)"
            parts.append(pred)
        if self.solve_time_ms is not None:
            parts.append(f"solve {self.solve_time_ms:.1f} ms")
        return f"{self.planner}: " + " | ".join(parts)

    def slow_ranks(self) -> list[tuple[int, float]]:
        """(position, speed) of the ranks the plan prices as slow (`plan.rank_speeds.slow_ranks`), slowest first."""
        return slow_ranks(self.rank_speeds)

    # ------------------------------------------------------------------ invariants
    def validate(self, max_tokens_per_rank: int | None = None) -> None:
        """Raise `PlanError` naming the offending sample or rank if any invariant fails.

        Invariants: every sample of the batch in exactly one microbatch of one group, only known ids;
        every rank in at least one group and at most one group per phase; no rankless group, no empty
        microbatch;
        no microbatch above the per-rank token cap (sum of tokens / group size <= cap); with P > 1 pipeline
        stages, nothing stage 0 of a position keeps in flight above the cap (P consecutive slots; interleaved,
        `in_flight_chunks` chunks of 1 / V: `plan.pipeline.in_flight_peak`).
        """
        cap = max_tokens_per_rank if max_tokens_per_rank is not None else self.max_tokens_per_rank
        n = self.world_size
        if not isinstance(n, int) or n < 1:
            raise PlanError(f"world_size {n!r} must be a positive integer")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise PlanError(f"gpus_per_node {self.gpus_per_node!r} must be a positive integer")
        if not isinstance(self.pipeline_stages, int) or self.pipeline_stages < 1:
            raise PlanError(f"pipeline_stages {self.pipeline_stages!r} must be a positive integer")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise PlanError(f"virtual_stages {self.virtual_stages!r} must be a positive integer")
        problem = interleaving_problem(self.pipeline_stages, self.virtual_stages)
        if problem is not None:
            raise PlanError(problem)
        if len(self._by_id) != len(self.samples):
            dup = next(i for i, c in Counter(s.id for s in self.samples).items() if c > 1)
            raise PlanError(f"sample id {dup} is listed twice in the plan's samples")
        if not self.groups:
            raise PlanError("the plan has no groups")

        footprint = None if cap is None else self.memory_rule(cap).footprint(self.samples, n)
        seen_in_phase: dict[tuple[int, int], int] = {}
        placed: dict[int, int] = {}
        for gi, g in enumerate(self.groups):
            if g.phase < 0:
                raise PlanError(f"group {gi} has negative phase {g.phase}")
            if not g.ranks:
                raise PlanError(f"group {gi} has no ranks")
            for r in g.ranks:
                if not 0 <= r < n:
                    raise PlanError(f"group {gi}: rank {r} is outside the domain 0..{n - 1}")
                key = (g.phase, r)
                if key in seen_in_phase:
                    raise PlanError(
                        f"rank {r} is in group {seen_in_phase[key]} and group {gi} of phase {g.phase}; "
                        "a rank may join at most one group per phase"
                    )
                seen_in_phase[key] = gi
            for mi, mb in enumerate(g.microbatches):
                if not mb:
                    raise PlanError(f"group {gi}, microbatch {mi} is empty")
                for sid in mb:
                    if sid not in self._by_id:
                        raise PlanError(f"group {gi}, microbatch {mi}: unknown sample id {sid}")
                    if sid in placed:
                        raise PlanError(f"sample {sid} is assigned twice (groups {placed[sid]} and {gi})")
                    placed[sid] = gi
        if footprint is not None:
            self._validate_memory(footprint)
        missing = [s.id for s in self.samples if s.id not in placed]
        if missing:
            raise PlanError(f"sample {missing[0]} is in no group ({len(missing)} samples unassigned)")
        idle = sorted(set(range(n)) - {r for _, r in seen_in_phase})
        if idle:
            raise PlanError(f"rank {idle[0]} is in no group ({len(idle)} ranks idle); every rank must join one")
        if footprint is not None and self.pipeline_stages > 1:
            self._validate_in_flight(footprint)

    def _validate_memory(self, footprint: Footprint) -> None:
        """No microbatch above the cap on any of its ranks (with uneven shares, its rank of the largest share)."""
        where = [(gi, mi, g) for gi, g in enumerate(self.groups) for mi in range(len(g.microbatches))]
        members = [self.positions(mb) for g in self.groups for mb in g.microbatches]
        fits = footprint.fits_each(members, [g.size for _, _, g in where], [g.shares for _, _, g in where])
        if all(fits):
            return
        k = fits.index(False)
        (gi, mi, g), index = where[k], members[k]
        encoder = ", encoder activations included" if self.enc_memory_per_token else ""
        encoder += ", gathered keys and values included" if self.kv_memory_per_token else ""
        rank = f"each of its {g.size} ranks" if not g.shares else \
            f"its rank of the largest share ({max(g.shares)} of {sum(g.shares)})"
        raise PlanError(
            f"group {gi}, microbatch {mi} puts {footprint.per_rank(index, g.size, g.shares):.0f} tokens "
            f"on {rank}{encoder}, above the cap of {footprint.cap}; split the microbatch or use more "
            "ranks" + (" or evener shares" if g.shares else "")
        )

    def memory_rule(self, cap: int) -> MemoryRule:
        """The plan's memory rule at a per-rank cap of `cap` tokens (`plan.memory`)."""
        return MemoryRule(cap, self.enc_memory_per_token, self.encoder_placement, self.kv_memory_per_token)

    def _validate_in_flight(self, footprint: Footprint) -> None:
        """The memory rule under pipeline parallelism: what stage 0 keeps in flight <= cap per rank."""
        p, v, cap = self.pipeline_stages, self.virtual_stages, footprint.cap
        for r, slots in enumerate(pipeline_slots(self)):
            held, first, last = in_flight_peak(slot_tokens_per_rank(self, slots, footprint), p, v)
            if held > cap:
                how = f"at {p} pipeline stages" + (f" of {v} virtual chunks" if v > 1 else "")
                raise PlanError(
                    f"position {r} holds {held:.0f} tokens per rank over slots {first}..{last}, which stage 0 "
                    f"keeps in flight {how}, above the cap of {cap}; use smaller microbatches or more ranks"
                )

    # ------------------------------------------------------------------ JSON
    def to_dict(self, *, timings: bool = True) -> dict:
        """The plan JSON (docs/plan-format.md); `timings=False` drops the measured fields."""
        out: dict = {
            "schema": SCHEMA,
            "planner": self.planner,
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
        }
        if self.max_tokens_per_rank is not None:
            out["max_tokens_per_rank"] = self.max_tokens_per_rank
        if self.phase_barrier:
            out["phase_barrier"] = True
        if self.pipeline_stages != 1:
            out["pipeline_stages"] = self.pipeline_stages
        if self.virtual_stages != 1:
            out["virtual_stages"] = self.virtual_stages
        if self.encoder_placement != "split":
            out["encoder_placement"] = self.encoder_placement
        if self.enc_memory_per_token:
            out["enc_memory_per_token"] = self.enc_memory_per_token
        if self.kv_memory_per_token:
            out["kv_memory_per_token"] = self.kv_memory_per_token
        out["samples"] = [s.to_dict() for s in self.samples]
        out["groups"] = [g.to_dict() for g in self.groups]
        if timings:
            if self.rank_speeds:
                out["rank_speeds"] = [round(v, 4) for v in self.rank_speeds]
            for key in ("predicted_step_time_s", "lower_bound_s", "solve_time_ms"):
                value = getattr(self, key)
                if value is not None:
                    out[key] = round(float(value), 6)
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        """`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def fingerprint(self) -> str:
        """A hash of everything that decides execution (not the timings), equal on every rank."""
        canonical = json.dumps(self.to_dict(timings=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        """Write the plan JSON to `path`."""
        Path(path).write_text(self.to_json(indent=1) + "\n")

    @classmethod
    def from_dict(cls, obj: dict) -> Plan:
        """Parse a plan-JSON object; a malformed one raises `PlanError` naming the field."""
        if not isinstance(obj, dict):
            raise PlanError("a plan must be a JSON object")
        if obj.get("schema") != SCHEMA:
            raise PlanError(f"plan schema {excerpt(obj.get('schema'))} is not {SCHEMA!r}")
        try:
            groups = tuple(
                PlanGroup(ranks=g["ranks"], microbatches=g["microbatches"], phase=g.get("phase", 0),
                          shares=g.get("shares", ()))
                for g in obj["groups"]
            )
            return cls(
                planner=str(obj["planner"]),
                world_size=int(obj["world_size"]),
                gpus_per_node=int(obj["gpus_per_node"]),
                samples=tuple(Sample.from_dict(s) for s in obj["samples"]),
                groups=groups,
                max_tokens_per_rank=obj.get("max_tokens_per_rank"),
                phase_barrier=bool(obj.get("phase_barrier", False)),
                pipeline_stages=obj.get("pipeline_stages", 1),
                virtual_stages=obj.get("virtual_stages", 1),
                encoder_placement=str(obj.get("encoder_placement", "split")),
                enc_memory_per_token=float(obj.get("enc_memory_per_token", 0.0)),
                kv_memory_per_token=float(obj.get("kv_memory_per_token", 0.0)),
                rank_speeds=tuple(obj.get("rank_speeds", ())),
                predicted_step_time_s=obj.get("predicted_step_time_s"),
                lower_bound_s=obj.get("lower_bound_s"),
                solve_time_ms=obj.get("solve_time_ms"),
            )
        except KeyError as e:
            raise PlanError(f"plan JSON is missing the key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, DhpError):
                raise
            raise PlanError(f"plan JSON has a malformed field: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan JSON file (not validated: call `validate`)."""
        return cls.from_dict(load_json_file(path, what="plan file", limit=PLAN_BYTES, error=PlanError))

