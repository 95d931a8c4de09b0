"""What `megatron-dhp train` runs: one frozen dataclass per YAML section, validated on construction.

The dataclasses are the source of truth (every key, its type, its default and its meaning); a YAML file
only loads into them through `config_io`, so an unknown key names the closest valid one. README.md lists
every key ("Training on CPU").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_dhp.config_io import check_fields, from_mapping, load_yaml_file, to_mapping
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.presets import resolve_preset
from megatron_dhp.runtime.model import TinyGPTConfig


@dataclass(frozen=True)
class ModelConfig(TinyGPTConfig):
    """The GPT to train: megatron-core's GPTModel with the DHP layer spec, RoPE, GQA, fp32.

    Keys: num_layers, hidden_size, num_attention_heads, num_query_groups (GQA key/value heads),
    ffn_hidden_size, vocab_size, max_sequence_length (RoPE table; at least the longest sample).
    """

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "vocab_size", "max_sequence_length"):
            if getattr(self, name) < 1:
                raise DhpError(f"model.{name} = {getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise DhpError(f"model.hidden_size {self.hidden_size} must be a multiple of "
                           f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise DhpError(f"model.num_attention_heads {self.num_attention_heads} must be a multiple of "
                           f"num_query_groups {self.num_query_groups}")


@dataclass(frozen=True)
class DataConfig:
    """Where sample lengths come from and what tokens fill them; batch k depends only on (seed, k)."""

    source: str = "wlbllm"
    """A length distribution from `megatron-dhp dists`, or a length file: a JSON array, JSONL with
    {"tokens": N} per line, or a Megatron .bin/.idx prefix (samples drawn from it with the seed)."""
    length_scale: float = 1.0
    """Multiply every drawn length by this (rounded, at least 1 token): scales GPU-sized corpora to a CPU."""
    global_batch: int = 16
    """Samples per step, over the whole domain."""
    seed: int = 0
    """Seed of the lengths and the token content: the same seed gives the same batches on any rank count."""
    noise: float = 0.1
    """Token content follows a fixed random successor table (a Markov chain the model can learn); this is the
    probability that the next token is drawn uniformly instead. The loss floor rises with it."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.length_scale <= 0:
            raise DhpError(f"data.length_scale = {self.length_scale} must be > 0")
        if self.global_batch < 1:
            raise DhpError(f"data.global_batch = {self.global_batch} must be >= 1")
        if not 0.0 <= self.noise <= 1.0:
            raise DhpError(f"data.noise = {self.noise} must be between 0 and 1")


@dataclass(frozen=True)
class RunConfig:
    """How long and how to train: steps, optimizer schedule, ranks, checkpoints."""

    steps: int = 40
    """Optimizer steps of the whole run (a resumed run continues up to this)."""
    lr: float = 3.0e-3
    """Peak learning rate (megatron-core Adam, reached after `warmup_steps`)."""
    min_lr: float = 3.0e-4
    """Learning rate at the last step (cosine decay from `lr`)."""
    warmup_steps: int = 4
    """Linear warm-up steps from 0 to `lr`."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    clip_grad: float = 0.0
    """Global gradient-norm clip (0: off). megatron-core's clip asserts CUDA tensors, so 0 on CPU."""
    seed: int = 0
    """Seed of the initial weights (independent of the rank count and of the planner)."""
    nproc: int = 0
    """Ranks to spawn when not under torchrun (0: one per CPU core, at least 2)."""
    tp: int = 1
    """Static tensor-parallel size; the dynamic domain is the other nproc / tp ranks."""
    save: str | None = None
    """Checkpoint directory (written every `save_interval` steps and after the last step)."""
    save_interval: int = 0
    """Steps between checkpoints (0: only after the last step, when `save` is set)."""
    load: str | None = None
    """Checkpoint directory to resume from (its latest complete checkpoint)."""
    timeout_s: float = 300.0
    """Longest any collective may wait before the job fails instead of hanging."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("steps", "tp"):
            if getattr(self, name) < 1:
                raise DhpError(f"train.{name} = {getattr(self, name)} must be >= 1")
        for name in ("warmup_steps", "save_interval", "nproc"):
            if getattr(self, name) < 0:
                raise DhpError(f"train.{name} = {getattr(self, name)} must be >= 0")
        if self.lr <= 0 or not 0 <= self.min_lr <= self.lr:
            raise DhpError(f"train.lr = {self.lr} must be > 0 and train.min_lr = {self.min_lr} between 0 and lr")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.timeout_s <= 0:
            raise DhpError("train.weight_decay and train.clip_grad must be >= 0 and train.timeout_s > 0")
        if self.warmup_steps >= self.steps:
            raise DhpError(f"train.warmup_steps = {self.warmup_steps} must be below train.steps = {self.steps}")
        if self.nproc and self.nproc % self.tp:
            raise DhpError(f"train.nproc = {self.nproc} must be a multiple of train.tp = {self.tp}")

    @property
    def num_ranks(self) -> int:
        """The ranks to spawn: `nproc`, or one per core (at least 2, rounded up to a multiple of tp)."""
        if self.nproc:
            return self.nproc
        n = max(2, os.cpu_count() or 1)
        return -(-n // self.tp) * self.tp


@dataclass(frozen=True)
class TrainConfig:
    """A whole training job: the model, the data, the run, and dynamic hybrid parallelism."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: RunConfig = field(default_factory=RunConfig)
    dhp: DhpConfig = field(default_factory=DhpConfig)

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_dict(cls, obj: object, *, source: str = "train config") -> TrainConfig:
        """Build from parsed YAML; every section and key is checked."""
        return from_mapping(cls, obj, source=source)

    @classmethod
    def load(cls, path_or_name: str | Path) -> TrainConfig:
        """Read a YAML file, or a config shipped in `configs/` by name (e.g. `demo_cpu`)."""
        path = resolve_preset(path_or_name, what="train config", noun="config")
        return cls.from_dict(load_yaml_file(path, what="train config"), source=f"train config {str(path)!r}")

    def to_dict(self) -> dict:
        """The YAML form `from_dict` reads back."""
        return to_mapping(self)

    def with_overrides(self, **sections: dict) -> TrainConfig:
        """Replace keys per section, ignoring None values (how command-line flags override the YAML)."""
        changes = {}
        for name, values in sections.items():
            kept = {k: v for k, v in values.items() if v is not None}
            if kept:
                changes[name] = replace(getattr(self, name), **kept)
        return replace(self, **changes)
