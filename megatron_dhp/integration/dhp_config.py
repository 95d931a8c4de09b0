"""What a user sets to train with megatron-dhp: one dataclass, loaded from YAML or Megatron flags.

The same settings drive `megatron-dhp train` (the `dhp:` section of its config) and Megatron-LM's
`--dhp-config FILE` (the whole file), so a plan behaves the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from megatron_dhp.closed_loop.speed_estimator import SpeedEstimator
from megatron_dhp.config_io import check_fields, from_mapping, load_yaml_file
from megatron_dhp.cost.speeds import expand_speeds, parse_slowdowns
from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.plan.comm import DEFAULT_COMMUNICATOR_MB, LAYER_SPECS, STEP_COMMS, CommPolicy
from megatron_dhp.plan.encoder import ENCODER_PLACEMENTS
from megatron_dhp.plan.memory import ModelMemory
from megatron_dhp.runtime.attention import BACKENDS

DEFAULT_COST = "gpt7b-64"
"""The cost preset a job plans with when it names none (scaled to its model where the model is known)."""


@dataclass(frozen=True)
class DhpConfig:
    """Planner, memory cap, attention variant and cost model of dynamic hybrid parallelism."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "comm": tuple(STEP_COMMS), "attention_backend": tuple(BACKENDS), "layer_spec": tuple(LAYER_SPECS),
        "encoder_placement": tuple(ENCODER_PLACEMENTS)}
    """The names each of these keys takes (its flag's choices too)."""

    planner: str = "dhp"
    """Planner name: dhp, static, megatron-hcp, fcp-ref or flexsp-milp (see `megatron-dhp simulate`)."""
    max_tokens_per_rank: int = 8192
    """Memory cap M: the most tokens one rank holds in a microbatch; a longer sample gets more ranks."""
    comm: str = "mixed"
    """Context-parallel communication inside a group: allgather (K/V), ring (P2P on the group), ulysses
    (all-to-all), p2p (the ring on the domain's communicator: no communicator per group) or mixed (allgather on
    the group family's communicators, created at start-up; p2p for any other group). Under p2p and mixed the
    planner may use any group; under the others it keeps to the family. Applies to layer_spec local;
    TransformerEngine's attention follows its own cp_comm_type on process groups, so with layer_spec te
    mixed runs as allgather (`effective_comm`: the family, or the planner's groups as under allgather)."""
    attention_backend: str = "auto"
    """Local attention kernel: auto (varlen on a GPU in bf16/fp16, flex on a GPU in fp32, sdpa on a CPU), varlen,
    flex, flash, sdpa, math ([runtime.md](runtime.md#per-microbatch-metadata-and-the-local-kernels))."""
    layer_spec: str = "local"
    """Core attention: local (megatron-dhp's, any device, with any linear layers) or te
    (TransformerEngine's, GPU; Megatron-LM needs --transformer-impl transformer_engine)."""
    cost: str | None = None
    """Cost model: a preset name from configs/ or a YAML path (e.g. from `megatron-dhp profile`). Its
    world_size, gpus_per_node and max_tokens_per_rank are replaced by the live job's. None: `DEFAULT_COST`,
    scaled to the job's model where the entry point knows it (Megatron-LM's flags: `cost.model_shape`)."""
    encoder_placement: str | None = None
    """Where a multimodal batch's images are encoded: split (over the sample's group), replicate (on every
    rank of the group), global (over the whole domain) or auto (the planner picks the faster per step);
    None: the cost model's key (split in the presets). docs/cost-model.md prices each."""
    gpus_per_node: int | None = None
    """GPUs per node, which decides the groups that stay on one node's fast links (default:
    LOCAL_WORLD_SIZE, as torchrun sets it)."""
    overlap_planning: bool = True
    """Plan step t+1 in a background thread while step t trains."""
    log_plans: bool = True
    """Log the one-line plan summary on rank 0: every --log-interval iterations under Megatron-LM (its scalars go
    to Megatron's TensorBoard and W&B writers either way), every step in `megatron-dhp train`."""
    max_groups: int = 256
    """Process groups kept alive in the pool before the least recently used is released."""
    max_groups_per_rank: int | None = None
    """The fixed family of groups created once at start-up, of which each rank joins at most this many
    (`plan.family`; 32: every sample size still has a group within one size step). Under comm allgather, ring and
    ulysses (and layer_spec te) the planner plans only with it, and 0 means any groups, created when a plan first
    needs them; default: the planner's own (32 for dhp; 0 for the peers, which plan as published). Under mixed
    it is the groups that run allgather (default 32; 0: none); ignored with p2p, which needs no group."""
    communicator_mb: float = DEFAULT_COMMUNICATOR_MB
    """GPU memory one NCCL communicator takes, in MB: the start-up log states the family's total per rank at
    this figure, and `memory_mb_per_token` turns it into tokens the cap gives up. The default is measured on
    an H200 and reported on A100s (docs/results.md); `bench/comm_memory.py` measures your GPUs."""
    memory_mb_per_token: float | None = None
    """A rank's activation memory per token of a microbatch, in MB: the communicators' memory is taken from the
    cap at this rate (max_tokens_per_rank - communicators x communicator_mb / this tokens per rank). None: on a
    GPU, estimated from the model (`plan.memory.ModelMemory`, Megatron-LM's count); 0: not counted
    (max_tokens_per_rank already leaves room for them). A CPU job's communicators hold no GPU memory: never
    counted there."""
    time_limit_s: float = 10.0
    """Solver time limit for planners that take one (flexsp-milp)."""
    truncate: bool = False
    """Cut samples longer than the whole domain holds (in the data pipeline) instead of stopping with an error."""
    adaptive: bool = True
    """Closed-loop planning: every rank times its slots, and the planner learns each rank's speed and the
    cost model's correction (two factors and sigma) from them (`closed_loop`), so slow ranks get
    less work and predicted step times follow the machine. Plans stay exact whatever the speeds; off: plan
    with the stated speeds. Off under pipeline parallelism, whose 1F1B slots are not timed (a start-up line
    says so)."""
    adaptive_window: int = 5
    """Steps each rank's speed is the median over (one outlier step moves no median)."""
    adaptive_hysteresis: float = 0.1
    """A rank's published speed changes only when its estimate moved more than this fraction, so noise does
    not re-plan; ranks within it of the typical rank plan at exactly 1."""
    rank_speeds: tuple[float, ...] = ()
    """Relative speed of every domain position, stated up front (a cluster of two GPU generations: 1.0 for
    the newer, about 0.45 for the older); the closed loop starts from them. Empty: every rank at 1."""
    node_speeds: tuple[float, ...] = ()
    """The same per node of gpus_per_node domain ranks (not with rank_speeds)."""
    slow_ranks: tuple[str, ...] = ()
    """Fault injection for tests and benchmarks: `RANK:FACTOR` makes that global rank hold each of its slots
    FACTOR times as long (it waits after the slot's compute, like a throttled GPU), changing no result. Refused
    under pipeline parallelism, whose 1F1B slots are not timed."""

    def __post_init__(self) -> None:
        from megatron_dhp.solver import PLANNERS

        check_fields(self)
        if self.planner not in PLANNERS:
            raise DhpError(f"planner {excerpt(self.planner)} is unknown; choose one of {', '.join(PLANNERS)}")
        for name, allowed in self.CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise DhpError(f"{name} {excerpt(value)} is unknown; choose one of {', '.join(allowed)}")
        self.comm_policy(world_size=1, gpus_per_node=1)  # the comm, layer spec and family bound, checked together
        for name in ("max_tokens_per_rank", "max_groups"):
            if getattr(self, name) < 1:
                raise DhpError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise DhpError(f"gpus_per_node = {self.gpus_per_node} must be >= 1 (or left out)")
        if self.memory_mb_per_token is not None and not self.memory_mb_per_token >= 0:
            raise DhpError(f"memory_mb_per_token = {self.memory_mb_per_token} must be >= 0 (0: not counted; left "
                           "out: estimated from the model on a GPU)")
        if self.time_limit_s <= 0:
            raise DhpError(f"time_limit_s = {self.time_limit_s} must be > 0")
        SpeedEstimator(1, window=self.adaptive_window, hysteresis=self.adaptive_hysteresis)  # checks both
        if self.rank_speeds and self.node_speeds:
            raise DhpError("give rank_speeds or node_speeds, not both")
        self.slowdowns  # noqa: B018 - parses slow_ranks

    @property
    def cost_name(self) -> str:
        """The cost preset or file this config plans with: `cost`, else `DEFAULT_COST`."""
        return self.cost or DEFAULT_COST

    @property
    def slowdowns(self) -> dict[int, float]:
        """`slow_ranks` as global rank -> factor."""
        return parse_slowdowns(self.slow_ranks)

    def stated_speeds(self, world_size: int, gpus_per_node: int) -> tuple[float, ...]:
        """The speeds the config states for a domain of this size (`rank_speeds` or `node_speeds`; empty: none)."""
        return expand_speeds(self.rank_speeds, self.node_speeds, world_size, gpus_per_node)

    @property
    def effective_comm(self) -> str:
        """The comm the steps run (`CommPolicy.effective_comm`): `mixed` runs as allgather under layer_spec te."""
        return self.comm_policy(world_size=1, gpus_per_node=1).effective_comm

    def comm_policy(self, *, world_size: int, gpus_per_node: int) -> CommPolicy:
        """The job's comm policy on a domain of `world_size` ranks, `gpus_per_node` of them per node."""
        from megatron_dhp.solver import planner_comm_policy

        return planner_comm_policy(self.planner, self.comm, world_size=world_size, gpus_per_node=gpus_per_node,
                                   max_groups_per_rank=self.max_groups_per_rank, layer_spec=self.layer_spec,
                                   communicator_mb=self.communicator_mb)

    def mb_per_token(self, model: ModelMemory | None) -> float:
        """The rate the communicators' memory turns into tokens (`job_spec.JobSpec.caps`): `memory_mb_per_token`,
        else the model's activation MB per token when the job gives one, else 0 (not counted)."""
        if self.memory_mb_per_token is not None:
            return self.memory_mb_per_token
        return model.activation_mb if model is not None else 0.0

    @classmethod
    def from_dict(cls, obj: object, *, source: str = "dhp config") -> DhpConfig:
        """Build from a parsed YAML mapping; unknown keys name the closest valid one."""
        return from_mapping(cls, obj, source=source)

    @classmethod
    def load(cls, path: str | Path) -> DhpConfig:
        """Read a `--dhp-config` YAML file."""
        return cls.from_dict(load_yaml_file(path, what="dhp config"), source=f"dhp config {str(path)!r}")
