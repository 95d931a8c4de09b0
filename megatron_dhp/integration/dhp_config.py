"""What a user sets to train with megatron-dhp: one dataclass, loaded from YAML or Megatron flags.

The same settings drive `megatron-dhp train` (the `dhp:` section of its config) and Megatron-LM's
`--dhp-config FILE` (the whole file), so a plan behaves the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_dhp.config_io import check_fields, from_mapping, load_yaml_file
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.encoder import ENCODER_PLACEMENTS
from megatron_dhp.runtime.attention import BACKENDS, DOMAIN_COMMS, LAYER_SPECS, STEP_COMMS


@dataclass(frozen=True)
class DhpConfig:
    """Planner, memory cap, attention variant and cost model of dynamic hybrid parallelism."""

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
    mixed becomes allgather (the family, or the planner's groups as under allgather)."""
    attention_backend: str = "auto"
    """Local attention kernel: auto (flash-attn on GPU when installed, else torch SDPA), math, sdpa, flash."""
    layer_spec: str = "local"
    """Core attention: local (megatron-dhp's, any device, with any linear layers) or te
    (TransformerEngine's, GPU; Megatron-LM needs --transformer-impl transformer_engine)."""
    cost: str = "gpt7b-64"
    """Cost model: a preset name from configs/ or a YAML path (e.g. from `megatron-dhp profile`). Its
    world_size, gpus_per_node and max_tokens_per_rank are replaced by the live job's."""
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
    """Log the one-line plan summary every step."""
    max_groups: int = 256
    """Process groups kept alive in the pool before the least recently used is released."""
    max_groups_per_rank: int | None = None
    """The fixed family of groups created once at start-up, of which each rank joins at most this many
    (`plan.family`; 32: every sample size still has a group within one size step). Under comm allgather, ring and
    ulysses (and layer_spec te) the planner plans only with it, and 0 means any groups, created when a plan first
    needs them; default: the planner's own (32 for dhp; 0 for the peers, which plan as published). Under mixed
    it is the groups that run allgather (default 32; 0: none); ignored with p2p, which needs no group."""
    time_limit_s: float = 10.0
    """Solver time limit for planners that take one (flexsp-milp)."""
    truncate: bool = False
    """Cut samples longer than the whole domain holds (in the data pipeline) instead of stopping with an error."""

    def __post_init__(self) -> None:
        from megatron_dhp.solver import PLANNERS

        check_fields(self)
        if self.planner not in PLANNERS:
            raise DhpError(f"planner {self.planner!r} is unknown; choose one of {', '.join(PLANNERS)}")
        for name, value, allowed in (("comm", self.comm, STEP_COMMS),
                                     ("attention_backend", self.attention_backend, BACKENDS),
                                     ("layer_spec", self.layer_spec, LAYER_SPECS)):
            if value not in allowed:
                raise DhpError(f"{name} {value!r} is unknown; choose one of {', '.join(allowed)}")
        if self.encoder_placement is not None and self.encoder_placement not in ENCODER_PLACEMENTS:
            raise DhpError(f"encoder_placement {self.encoder_placement!r} is unknown; choose one of "
                           f"{', '.join(ENCODER_PLACEMENTS)}")
        if self.layer_spec == "te" and self.comm == "mixed":  # TE has no p2p path: every group gets a process group
            object.__setattr__(self, "comm", "allgather")
        if self.layer_spec == "te" and self.comm in DOMAIN_COMMS:
            raise DhpError(f"comm {self.comm!r} gives a group no process group, which TransformerEngine's attention "
                           "needs; use layer_spec local with it, or another comm")
        for name in ("max_tokens_per_rank", "max_groups"):
            if getattr(self, name) < 1:
                raise DhpError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise DhpError(f"gpus_per_node = {self.gpus_per_node} must be >= 1 (or left out)")
        if self.max_groups_per_rank is not None and self.max_groups_per_rank < 0:
            raise DhpError(f"max_groups_per_rank = {self.max_groups_per_rank} must be >= 0 (0: no group family)")
        if self.time_limit_s <= 0:
            raise DhpError(f"time_limit_s = {self.time_limit_s} must be > 0")

    @classmethod
    def from_dict(cls, obj: object, *, source: str = "dhp config") -> DhpConfig:
        """Build from a parsed YAML mapping; unknown keys name the closest valid one."""
        return from_mapping(cls, obj, source=source)

    @classmethod
    def load(cls, path: str | Path) -> DhpConfig:
        """Read a `--dhp-config` YAML file."""
        return cls.from_dict(load_yaml_file(path, what="dhp config"), source=f"dhp config {str(path)!r}")
