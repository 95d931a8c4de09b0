"""Where the vision encoder runs, and what its work costs under each placement (their names: `plan.encoder`).

An item's encoder attends only inside each of its blocks (a tile, a frame), so its seconds on one rank are
    w(item) = e sum_blocks b^2 + f enc       (forward + backward; FORWARD_SHARE of it when the encoder is frozen)
and never e enc^2. A placement decides who runs that work:
- `split`: the sample's group spreads its items' blocks over its d ranks: w / d inside the sample's time
  (the reference model's formula, the reference presets' default);
- `replicate`: every rank of the group encodes all the group's items: w inside the sample's time, not divided;
- `global`: the blocks of the whole batch are balanced over all N ranks (longest first to the least loaded)
  before the first microbatch, the embeddings go to their samples' LLM ranks in one all-to-all, and the
  encoder backward runs once after the last microbatch (gradients back in a second all-to-all); the groups
  then carry LLM work only.
`auto` is not a way to run the encoder: the planner plans under each concrete placement and keeps the
lower predicted step (`solver.encoder_auto`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from megatron_dhp.plan.memory import longest_first_makespan
from megatron_dhp.workload.sample import Sample

if TYPE_CHECKING:
    from megatron_dhp.cost.config import CostConfig

FORWARD_SHARE = 1.0 / 3.0
"""The forward's share of an encoder's forward+backward seconds (a backward costs about twice the forward):
all a frozen encoder runs, and what `global` runs before the first microbatch."""


def block_work(config: CostConfig, blocks: np.ndarray, *, linear: bool = True) -> np.ndarray:
    """Forward+backward seconds of encoder blocks on one rank: e b^2 + f b each (without `linear`: e b^2)."""
    return config.enc_attn_s_per_token2 * blocks**2 + (config.enc_linear_s_per_token * blocks if linear else 0.0)


def sample_encoder_work(config: CostConfig, samples: Sequence[Sample], *, linear: bool = True) -> np.ndarray:
    """Each sample's encoder seconds on one rank, summed per block (frozen: the forward only); without `linear`
    its attention only (e b^2)."""
    if not any(s.images for s in samples):  # text only: no per-sample sums (the planner asks every step)
        return np.zeros(len(samples))
    counts = np.fromiter((sum(len(item.blocks) for item in s.images) for s in samples), dtype=np.int64,
                         count=len(samples))
    if not counts.any() or not (config.enc_attn_s_per_token2 or (linear and config.enc_linear_s_per_token)):
        return np.zeros(len(samples))
    blocks = np.fromiter(chain.from_iterable(item.blocks for s in samples for item in s.images),
                         dtype=np.float64, count=int(counts.sum()))
    work = np.bincount(np.repeat(np.arange(len(samples)), counts), weights=block_work(config, blocks, linear=linear),
                       minlength=len(samples))
    return work * FORWARD_SHARE if config.encoder_frozen else work


class SampleWork(np.ndarray):
    """Per-sample one-rank compute seconds (what planners sort, index and hand back to the cost model),
    carrying `fixed`: the part of each that a group of d ranks does not divide (the encoder under
    `replicate`). Indexing indexes both, so a planner's slices keep it."""

    fixed: np.ndarray

    def __new__(cls, total: np.ndarray, fixed: np.ndarray) -> SampleWork:  # noqa: D102 - the class says it
        obj = np.asarray(total, dtype=np.float64).view(cls)
        obj.fixed = np.asarray(fixed, dtype=np.float64)
        return obj

    def __array_finalize__(self, obj: object) -> None:
        self.fixed = getattr(obj, "fixed", None)

    def __getitem__(self, key: object) -> object:
        out = super().__getitem__(key)
        if isinstance(out, SampleWork):
            out.fixed = self.fixed[key]
        return out


def fixed_work(work: np.ndarray) -> np.ndarray | None:
    """The undivided part of a work array (None: all of it splits over the group)."""
    return getattr(work, "fixed", None)


@dataclass(frozen=True)
class EncoderPhase:
    """The step-level encoder time of `global` (zero under the other placements), outside every group."""

    before_s: float = 0.0
    """Before the first microbatch on every rank: the balanced encoder forward and the embeddings' all-to-all."""
    after_s: float = 0.0
    """After the last microbatch: the gradients' all-to-all and the balanced encoder backward (0 when frozen)."""

    @property
    def total_s(self) -> float:
        """Both parts: what the phase adds to the step."""
        return self.before_s + self.after_s


def global_phase(config: CostConfig, samples: Sequence[Sample], *, bound: bool = False) -> EncoderPhase:
    """The encoder phase of `global`: blocks over all N ranks by LPT (`bound`: max(sum / N, largest block), a
    makespan no assignment beats), and the embeddings' all-to-all of `enc_a2a_bytes_per_token` per LLM token
    (forward+backward; each rank keeps 1 / N of its own), at the inter-node bandwidth unless the domain is one
    node."""
    n = config.world_size
    blocks = np.fromiter((b for s in samples for item in s.images for b in item.blocks), dtype=np.float64)
    work = block_work(config, blocks)
    span = max(float(work.sum()) / n, float(work.max(initial=0.0))) if bound else longest_first_makespan(work, n)
    llm = sum(item.llm for s in samples for item in s.images)
    bw = config.intra_node_bytes_per_s if n <= config.gpus_per_node else config.inter_node_bytes_per_s
    a2a = config.enc_a2a_bytes_per_token * llm / n * (n - 1) / n / bw / 2  # one direction
    if config.encoder_frozen:
        return EncoderPhase(FORWARD_SHARE * span + a2a, 0.0)
    return EncoderPhase(FORWARD_SHARE * span + a2a, a2a + (1.0 - FORWARD_SHARE) * span)
