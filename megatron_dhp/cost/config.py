"""Cost-model configuration: the dynamic domain and the coefficients, loaded from YAML.

The dataclass is the source of truth; YAML only loads into it (`yaml.safe_load`, every key checked).
Keys and units are those of the reference model (docs/cost-model.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import yaml

from megatron_dhp.config_io import check_fields, from_mapping, load_yaml_file
from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.plan.encoder import ENCODER_PLACEMENTS
from megatron_dhp.plan.rank_speeds import on_speed_grid
from megatron_dhp.presets import resolve_preset

COST_KINDS = ("reference", "profiled")
CP_COMMS = ("ring", "all-to-all")
"""How a context-parallel group exchanges attention inputs: ring (Megatron's CP: every rank sees every other
rank's keys and values) or all-to-all (DeepSpeed-Ulysses, FlexSP: heads scattered, sequence gathered)."""
OPTIONAL_KEYS = ("description", "sample_overhead_s", "cp_microbatch_overhead_s", "step_overhead_s",
                 "moe_expert_s_per_token", "moe_a2a_bytes_per_token", "expert_parallel_size", "merge",
                 "encoder_placement", "encoder_frozen", "enc_a2a_bytes_per_token", "enc_memory_per_token",
                 "kv_memory_per_token",
                 "rank_speeds", "uneven_shards", "speed_scales_comm", "cp_comm", "tensor_parallel", "tp_efficiency", "tp_comm_bytes_per_token",
                 "attention_heads", "memory_budget_bytes", "model_state_bytes", "activation_bytes_per_token",
                 "sharded_state_bytes", "fsdp_gather_bytes")
"""Keys `to_dict` writes only when set: s, lambda, sigma and the MoE terms are absent from reference files."""


SECONDS_KEYS = ("attn_s_per_token2", "linear_s_per_token", "microbatch_overhead_s", "enc_attn_s_per_token2",
                "enc_linear_s_per_token", "sample_overhead_s", "cp_microbatch_overhead_s", "step_overhead_s",
                "moe_expert_s_per_token")
"""The coefficients in seconds (`CostConfig.scaled` multiplies them)."""
TOKEN_KEYS = ("attn_s_per_token2", "linear_s_per_token")
"""The keys that price a token's own work: a model needs one above 0 (`CostConfig` refuses it otherwise, and
the profile's fit keeps one), or no step could be priced against its bound."""
ATTENTION_KEYS = ("attn_s_per_token2", "enc_attn_s_per_token2")
"""The quadratic ones, which `CostConfig.scaled` may scale apart."""


def check_speeds(speeds: tuple[float, ...], world_size: int) -> None:
    """A `DhpError` unless `speeds` is empty or holds one finite positive speed per rank."""
    if speeds and len(speeds) != world_size:
        raise DhpError(f"rank_speeds holds {len(speeds)} speeds but the domain has {world_size} ranks; give one "
                       "relative speed per domain position (or none: every rank at 1.0)")
    bad = next((v for v in speeds if not (np.isfinite(v) and v > 0)), None)
    if bad is not None:
        raise DhpError(f"rank speed {bad!r} must be a finite number > 0 (1.0: the model's nominal rank)")


@dataclass(frozen=True)
class Domain:
    """The dynamic domain: the DP x CP ranks that share one TP/PP coordinate."""

    world_size: int
    """Ranks in the domain (N)."""
    gpus_per_node: int
    """Ranks per node; a group inside one node communicates at the intra-node bandwidth."""
    max_tokens_per_rank: int
    """Memory capacity M: the most tokens one rank may hold in a microbatch."""
    rank_speeds: tuple[float, ...] = ()
    """Each domain position's relative compute speed (1.0: the model's nominal rank; `plan.speeds`); empty: all 1."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("world_size", "gpus_per_node", "max_tokens_per_rank"):
            value = getattr(self, name)
            if value < 1:
                raise DhpError(f"{name} = {value!r} must be an integer >= 1 (set --{name.replace('_', '-')})")
        check_speeds(self.rank_speeds, self.world_size)

    @functools.cached_property
    def speeds(self) -> np.ndarray:
        """Every position's speed (ones when `rank_speeds` is empty); read-only, made once (planners ask per
        group)."""
        speeds = np.asarray(self.rank_speeds, dtype=np.float64) if self.rank_speeds else np.ones(self.world_size)
        speeds.flags.writeable = False
        return speeds

    @functools.cached_property
    def nominal(self) -> bool:
        """Whether every rank runs at speed 1 (then every plan and number is the speed-blind one; asked per
        group priced, so computed once)."""
        return all(v == 1.0 for v in self.rank_speeds)

    def fastest_groups(self, uneven: bool = False) -> np.ndarray:
        """v_d, d = 1..N: the most speed a group of d ranks computes at, the d-th fastest rank's (even shards:
        the group waits for its slowest), or with `uneven` shards the mean of the d fastest (`plan.shares`)."""
        fastest = np.sort(self.speeds)[::-1]
        return np.cumsum(fastest) / np.arange(1, len(fastest) + 1) if uneven else fastest

    def slowest_groups(self) -> np.ndarray:
        """u_d, d = 1..N: the mean speed of the d slowest ranks. Any d ranks' speeds sum to at least d u_d, so a
        sample on d ranks costs at least d u_d times its communication in speed-weighted rank-seconds (the
        bounds' area term; pricing it at d times the slowest rank's speed credits every wide sample with a
        whole group of the one slowest rank)."""
        return np.cumsum(np.sort(self.speeds)) / np.arange(1, self.world_size + 1)

    def speed_levels(self, uneven: bool = False) -> list[tuple[float, int, int]]:
        """(v, a, b): the fastest group of d ranks, a <= d <= b, computes at most at speed v, `fastest_groups`
        rounded up to the speed grid (`plan.rank_speeds.SPEED_GRID`: few levels, and a speed the closed loop
        published is on it exactly; rounding up keeps bounds valid)."""
        levels = on_speed_grid(self.fastest_groups(uneven), up=True)
        out: list[tuple[float, int, int]] = []
        for d, v in enumerate(levels.tolist(), start=1):
            if out and out[-1][0] == v:
                out[-1] = (v, out[-1][1], d)
            else:
                out.append((v, d, d))
        return out

    @property
    def capacity(self) -> int:
        """The longest sample the whole domain can hold: N x M."""
        return self.world_size * self.max_tokens_per_rank


@dataclass(frozen=True)
class CostConfig:
    """Every parameter of a cost model; see docs/cost-model.md for the formulas."""

    kind: str
    """`reference` (the published coefficients, docs/cost-model.md) or `profiled` (fitted by `megatron-dhp profile`)."""
    world_size: int
    """N: ranks of the dynamic domain (the DP x CP ranks of one TP/PP coordinate)."""
    gpus_per_node: int
    """Ranks per node: a group whose ranks share a node communicates at the intra-node bandwidth."""
    max_tokens_per_rank: int
    """M: the most tokens one rank may hold in a microbatch (sum of L / d <= M)."""
    attn_s_per_token2: float
    """a: attention seconds per token^2 (whole model, forward+backward, one rank)."""
    linear_s_per_token: float
    """b: seconds per token of the linear layers."""
    microbatch_overhead_s: float
    """m: fixed seconds per microbatch on every rank of its group."""
    comm_bytes_per_token: float
    """gamma: bytes a context-parallel group moves per token over all layers, forward+backward."""
    intra_node_bytes_per_s: float
    """Bandwidth of a group inside one node."""
    inter_node_bytes_per_s: float
    """Bandwidth of a group that spans nodes."""
    overlap_comm: bool
    """Whether communication overlaps compute: t = max(compute, comm) instead of the sum."""
    enc_attn_s_per_token2: float = 0.0
    """e: vision-encoder attention seconds per image token^2."""
    enc_linear_s_per_token: float = 0.0
    """f: vision-encoder seconds per image token."""
    merge: int = 4
    """Encoder tokens per LLM token of an image (2x2 merge, pixel shuffle: 4; 1 feeds every patch to the LLM):
    a short-form image of P encoder tokens takes ceil(P / merge) of its sample's LLM tokens."""
    encoder_placement: str = "split"
    """Where the vision encoder runs: split (the sample's group shares it, the reference formula), replicate
    (every rank of the group runs all of it), global (balanced over the domain) or auto (the planner tries
    each and keeps the fastest); see docs/cost-model.md."""
    encoder_frozen: bool = False
    """A frozen encoder runs no backward: its items cost the forward's third of e and f."""
    enc_a2a_bytes_per_token: float = 0.0
    """Bytes of one LLM token's image embedding moved by `global`'s all-to-all, forward+backward (hidden x
    bytes x 2)."""
    enc_memory_per_token: float = 0.0
    """w: activation memory of one encoder token, kept until the encoder's backward, in LLM tokens (about the
    encoder's hidden size x layers over the LLM's: 0.19 for a 300M ViT on GPT-7B). It counts against
    max_tokens_per_rank as the placement puts it (`plan.memory`); 0, the reference model, counts LLM tokens
    only."""
    kv_memory_per_token: float = 0.0
    """g: one token's keys and values in LLM tokens of activations (2 x query groups x head size over about
    18 x hidden + 4 x ffn per layer: 0.03 for Llama-3-8B), which every rank of a group keeps whole under the
    all-gather variant, whatever the group's size (`plan.memory`). A live job on a GPU sets it from its model
    when some group gathers; 0, the reference model, does not count it."""
    sample_overhead_s: float = 0.0
    """s: fixed seconds per sample on every rank of its group, not divided by d (per-sample work that each
    rank repeats: megatron's THD RoPE and varlen attention loop over samples). Added to t(L, d); 0 in the
    reference model. d t(L, d) stays non-decreasing in d, so the lower bound stays valid."""
    cp_microbatch_overhead_s: float = 0.0
    """lambda: extra seconds of a microbatch on a group of more than one rank, the fixed latency of its
    context-parallel collectives (large for gloo on a CPU; 0 in the reference model). The simulated step time
    and every planner that prices microbatches include it; the lower bound ignores it and stays valid because it only adds time."""
    step_overhead_s: float = 0.0
    """sigma: fixed seconds every step adds to its microbatches (on a CPU a few ms: the gaps between them,
    caches cold after the optimizer, the planning thread; 0 in the reference model). Every plan pays it once,
    so the simulated step time and the lower bound both include it and no planner decision changes."""
    moe_expert_s_per_token: float = 0.0
    """x: expert-MLP seconds per token of a mixture-of-experts model (its top-k experts, all MoE layers,
    forward+backward, one rank); split over a sample's group like b. 0: a dense model."""
    moe_a2a_bytes_per_token: float = 0.0
    """alpha: bytes the MoE token dispatcher's all-to-all moves per token over all MoE layers, forward+backward
    (dispatch and combine: hidden x bytes x top-k x 2 x 2 x layers x (EP - 1) / EP); runs on the EP group and
    adds to compute (megatron-core does not overlap it with the experts)."""
    expert_parallel_size: int = 1
    """EP: ranks of the static expert-parallel groups the all-to-all runs on, consecutive domain ranks tiling the
    domain (must divide world_size); intra-node bandwidth when every group sits in one node."""
    rank_speeds: tuple[float, ...] = ()
    """Each domain position's relative compute speed, 1.0 the rank these coefficients describe (a throttled
    or older GPU: below 1); empty, the default, is every rank at 1. A group computes at its slowest member's
    speed, or with `uneven_shards` at its pace (docs/cost-model.md#uneven-shards); communication is not scaled
    unless `speed_scales_comm` (docs/cost-model.md)."""
    uneven_shards: bool = True
    """Whether a group whose members run at different speeds gives each a share of every sample in proportion
    to its speed (`plan.shares`), so they finish together; false: every member an equal share, the group at
    its slowest's speed. Equal speeds plan and run as before either way."""
    speed_scales_comm: bool = False
    """Whether a slow rank's communication slows with it: true where collectives are work on the ranks' own
    cores (gloo on a CPU, where a busy neighbour takes the copies' time too, and `profile` sets it on gloo),
    false where links and copy engines carry them (NCCL on GPUs, the reference model). With it a group's
    whole time, lambda included, divides by its slowest rank's speed."""
    cp_comm: str = "ring"
    """How a context-parallel group of d ranks exchanges attention inputs, and so how its comm scales:
    `ring` (Megatron's context parallelism, the reference model: each rank receives the other ranks' keys and
    values, gamma L (d - 1) / d bytes) or `all-to-all` (DeepSpeed-Ulysses, as FlexSP runs it: each rank sends
    (d - 1) / d of its own L / d tokens' attention inputs and outputs, gamma L (d - 1) / d^2; gamma is then
    those bytes per token, 4 all-to-alls x 2 x hidden x bytes x layers). The planners do not check that d
    divides the heads, which all-to-all needs."""
    tensor_parallel: int = 1
    """t: each domain position is a tensor-parallel group of t GPUs of one node, with sequence parallelism.
    The other keys then describe one GPU without tensor parallelism (world_size and gpus_per_node count GPUs,
    max_tokens_per_rank is one GPU's), and `cost.tensor_parallel` prices the N / t positions from them
    (docs/cost-model.md#tensor-parallelism). 1: positions are GPUs, as every config before this key."""
    tp_efficiency: float = 1.0
    """The share of the ideal t-fold speed-up of the linear and attention compute that each doubling of t
    keeps (thinner GEMMs, per-layer launch gaps): a position at t computes at t x tp_efficiency^log2(t)."""
    tp_comm_bytes_per_token: float = 0.0
    """Bytes the tensor-parallel collectives move per token over all layers, forward+backward, before the
    (t - 1) / t of a ring: with sequence parallelism an all-gather and a reduce-scatter of the token's
    activations around attention and around the MLP, each way (8 x hidden x bytes x layers). Runs on the
    intra-node links; added to the linear compute, or overlapped with it under `overlap_comm`."""
    attention_heads: int = 0
    """The model's attention heads (0: not stated), checked against tensor_parallel: t must divide them."""
    memory_budget_bytes: float = 0.0
    """One GPU's memory for the model's states and its activations (0: not stated; max_tokens_per_rank then
    gives the cap as it is). With it, a position's cap is derived: M_t = floor((budget x t - model_state_bytes)
    / activation_bytes_per_token) (`cost.tensor_parallel.token_cap`)."""
    model_state_bytes: float = 0.0
    """Weights, gradients and optimizer states of the whole model on one GPU without tensor parallelism (a
    TP group of t holds 1 / t of them per GPU)."""
    activation_bytes_per_token: float = 0.0
    """Activation memory one token keeps on one GPU without tensor parallelism, kept until its backward
    (sequence parallelism splits it t ways)."""
    sharded_state_bytes: float = 0.0
    """States the data-parallel domain shards over all its world_size GPUs whatever t is: the distributed
    optimizer's fp32 master weights and Adam moments (12 bytes per parameter), and under fully sharded data
    parallelism also the weights and gradients (18 in all; `model_state_bytes` then 0). Counts against
    memory_budget_bytes as sharded_state_bytes / world_size per GPU."""
    fsdp_gather_bytes: float = 0.0
    """Fully sharded data parallelism: the bytes of one GPU's per-microbatch parameter traffic without tensor
    parallelism, before the (n - 1) / n of a ring over the domain's n positions: the weights all-gathered
    for the forward and again for the backward, the gradients reduce-scattered (3 x 2 bytes per parameter
    in bf16); 1 / t of it at TP t. Every rank of the domain joins each microbatch's collectives, so a plan
    runs in lockstep slots; bench/fsdp_tp.py prices them (`lockstep_step`), `simulate` and the planners do
    not; 0: no FSDP."""
    description: str = ""
    """Free text: where the numbers come from."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.kind not in COST_KINDS:
            raise DhpError(f"cost kind {excerpt(self.kind)} is unknown; use one of {', '.join(COST_KINDS)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and (value < 0 or (f.name.endswith("bytes_per_s") and value <= 0)):
                raise DhpError(f"cost key {f.name!r} = {value!r} must be {'>' if 'per_s' in f.name else '>='} 0")
        if not any(getattr(self, key) for key in TOKEN_KEYS):
            raise DhpError(f"cost keys {' and '.join(map(repr, TOKEN_KEYS))} are both 0: a token would take no "
                           "time, so no step could be priced against its bound; give at least one (megatron-dhp "
                           "profile measures both)")
        self.domain  # noqa: B018 - validates the domain fields
        if self.merge < 1:
            raise DhpError(f"cost key 'merge' = {self.merge!r} must be an integer >= 1 (encoder tokens per LLM token)")
        if self.cp_comm not in CP_COMMS:
            raise DhpError(f"cost key 'cp_comm' = {excerpt(self.cp_comm)} is unknown; use one of {', '.join(CP_COMMS)}")
        if self.encoder_placement not in ENCODER_PLACEMENTS:
            raise DhpError(f"cost key 'encoder_placement' = {excerpt(self.encoder_placement)} is unknown; use one of "
                           f"{', '.join(ENCODER_PLACEMENTS)}")
        ep = self.expert_parallel_size
        if ep < 1 or self.world_size % ep:
            raise DhpError(f"cost key 'expert_parallel_size' = {ep!r} must be >= 1 and divide world_size = "
                           f"{self.world_size} (the expert-parallel groups tile the domain)")
        t = self.tensor_parallel
        if t < 1 or self.gpus_per_node % t or self.world_size % t:
            raise DhpError(f"cost key 'tensor_parallel' = {t!r} must be >= 1 and divide gpus_per_node = "
                           f"{self.gpus_per_node} and world_size = {self.world_size} (a tensor-parallel group sits "
                           "in one node)")
        if t > 1 and self.attention_heads and self.attention_heads % t:
            raise DhpError(f"cost key 'tensor_parallel' = {t} must divide attention_heads = {self.attention_heads} "
                           "(each GPU of a tensor-parallel group holds whole heads)")
        if self.memory_budget_bytes and not self.activation_bytes_per_token:
            raise DhpError("cost key 'memory_budget_bytes' needs activation_bytes_per_token > 0 (what one token keeps "
                           "on a GPU) to derive max_tokens_per_rank")
        if not 0 < self.tp_efficiency <= 1:
            raise DhpError(f"cost key 'tp_efficiency' = {self.tp_efficiency!r} must be in (0, 1]")
        if self.moe_a2a_bytes_per_token and ep == 1:
            raise DhpError(f"cost key 'moe_a2a_bytes_per_token' = {self.moe_a2a_bytes_per_token!r} needs "
                           "expert_parallel_size > 1 (an expert-parallel group of one rank moves nothing)")

    @property
    def domain(self) -> Domain:
        """The domain fields as a `Domain`."""
        return Domain(self.world_size, self.gpus_per_node, self.max_tokens_per_rank, self.rank_speeds)

    def scaled(self, factor: float, attention: float | None = None) -> CostConfig:
        """Every time the model gives, times `factor`: each seconds coefficient multiplied, each bandwidth
        divided; with `attention`, the attention coefficients (a, e) by that instead (how the closed loop
        corrects the model, `closed_loop.loop`)."""
        attention = factor if attention is None else attention
        if factor == attention == 1.0:
            return self
        times = {name: getattr(self, name) * (attention if name in ATTENTION_KEYS else factor) for name in SECONDS_KEYS}
        links = {name: getattr(self, name) / factor for name in ("intra_node_bytes_per_s", "inter_node_bytes_per_s")}
        return replace(self, **times, **links)

    def with_overrides(self, **overrides: int | tuple[float, ...] | None) -> CostConfig:
        """Replace the given fields, ignoring None (how CLI flags override the YAML)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict:
        """Every field, as the YAML keys (the optional ones only when not at their defaults: reference files
        stay as they were)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in OPTIONAL_KEYS or getattr(self, f.name) != f.default}

    # ------------------------------------------------------------------ YAML
    @classmethod
    def from_dict(cls, obj: object, *, source: str = "cost config") -> CostConfig:
        """Check keys (unknown: closest valid name; missing: the required list) and build."""
        return from_mapping(cls, obj, source=source)

    @classmethod
    def load(cls, path_or_preset: str | Path) -> CostConfig:
        """Load a YAML file, or a preset name from `configs/` (e.g. `gpt7b-64`)."""
        path = resolve_preset(path_or_preset, what="cost config")
        return cls.from_dict(load_yaml_file(path, what="cost config"), source=f"cost config {str(path)!r}")

    def save(self, path: str | Path) -> None:
        """Write the YAML form `load` reads back."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
