"""The plain data a step passes around: samples as the loader gives them, the gathered batch, and this rank's
share of the step (its microbatches, and its images when the batch has any).

No collective here: `collectives` fills a `GatheredBatch`, `dispatch.move_tokens` builds the `StepInputs`,
`vision.move_images` its `VisionInputs`; the engine, the step runners and the Megatron-LM hooks read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.layout import MicrobatchLayout, SlotRows
from megatron_dhp.workload.sample import Batch


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
    reports: tuple[tuple[float, ...], ...] = ()
    """Each position's report that rode along (`collectives.gather_batch`: the closed loop's measurement)."""


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
class VisionInputs:
    """This rank's part of a step's images: the tiles it encodes and where their embedding rows go."""

    pixels: torch.Tensor
    """[tiles, 3, h, w]: the tiles of the images this rank encodes, image after image in canonical order."""
    send_rows: torch.Tensor
    """Rows of this rank's encoder output to send, destination after destination."""
    send_counts: list[int]
    recv_counts: list[int]
    microbatch_rows: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """Per microbatch of this rank (execution order): its image slots, and the received rows that fill them."""


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
