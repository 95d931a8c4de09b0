"""A tiny InternVL-shaped vision-language model from megatron-core's own blocks, for exactness checks.

Vision: megatron-core's `CLIPViTModel` (subtype `internvit`: no class token, no pre/post norm) whose layers
attend bidirectionally inside each tile. megatron-core 0.16.1's local ViT spec is causal
(`vit_layer_specs.py:72`), which is wrong for an encoder, so the spec here sets `no_mask`. Then InternVL's
pixel shuffle (0.5: 4 patches -> one token) and megatron-core's `MultimodalProjector` (MLP) to the LLM
width. Language: the tiny GPT of `models.gpt`, with dynamic-CP attention, fed the merged embeddings
through `GPTModel.forward(decoder_input=...)`: text rows from its own word embedding, image rows from the
projector. Every tile is one block of the encoder's attention; an image of k tiles occupies k x
`tokens_per_tile` LLM tokens, so the merge factor is `patches_per_tile / tokens_per_tile` = 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.models.multimodal.llava_model import pixel_shuffle
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dhp.errors import DhpError
from megatron_dhp.models.gpt import TinyGPTConfig, build_tiny_gpt, init_weights_
from megatron_dhp.runtime.step_data import ImageInput, TokenSample
from megatron_dhp.workload.sample import Batch

PIXEL_SHUFFLE = 0.5
"""InternVL's scale: every 2 x 2 patches become one token of 4x the width."""
IMAGE_PLACEHOLDER = 0
"""Token id at an image's positions (its word embedding is replaced; the id never reaches the loss)."""


@dataclass(frozen=True)
class VisionTowerConfig:
    """The vision tower: a ViT over square tiles, each tile one block of its attention."""

    layers: int = 2
    """Transformer layers of the vision encoder (bidirectional attention within a tile)."""
    hidden_size: int = 32
    """Width of the vision encoder; a multiple of num_attention_heads."""
    num_attention_heads: int = 4
    """Attention heads of the vision encoder."""
    tile_px: int = 28
    """Side of a square tile in pixels; an image is 1 or more tiles (InternVL's dynamic tiling)."""
    patch_px: int = 7
    """Side of a patch: a tile has (tile_px / patch_px)^2 encoder tokens (16 by default)."""

    def __post_init__(self) -> None:
        side = self.tile_px // self.patch_px
        if self.tile_px % self.patch_px or side % 2:
            raise DhpError(f"tile_px {self.tile_px} must be an even multiple of patch_px {self.patch_px} "
                           "(pixel shuffle merges 2 x 2 patches)")
        if self.hidden_size % self.num_attention_heads:
            raise DhpError(f"the vision tower's hidden_size {self.hidden_size} must divide by its "
                           f"num_attention_heads {self.num_attention_heads}")

    @property
    def patches_per_tile(self) -> int:
        """Encoder tokens of one tile (one block of the encoder's attention)."""
        return (self.tile_px // self.patch_px) ** 2

    @property
    def tokens_per_tile(self) -> int:
        """LLM tokens one tile becomes after the pixel shuffle."""
        return round(self.patches_per_tile * PIXEL_SHUFFLE**2)

    @property
    def merge(self) -> int:
        """Encoder tokens per LLM token (the merge factor of docs/plan-format.md)."""
        return self.patches_per_tile // self.tokens_per_tile


@dataclass(frozen=True)
class TinyVLMConfig:
    """The language model (a `TinyGPTConfig`), the vision tower in front of it, and the projector between."""

    language: TinyGPTConfig = field(default_factory=TinyGPTConfig)
    tower: VisionTowerConfig = field(default_factory=VisionTowerConfig)

    def vision_config(self) -> TransformerConfig:
        """fp32, no fusions, no dropout, like the language model's."""
        lm = self.language.transformer_config()
        return TransformerConfig(
            num_layers=self.tower.layers,
            hidden_size=self.tower.hidden_size,
            num_attention_heads=self.tower.num_attention_heads,
            ffn_hidden_size=4 * self.tower.hidden_size,
            **{k: getattr(lm, k) for k in _SHARED_SETTINGS},
        )

    def projector_config(self) -> TransformerConfig:
        """The projector's MLP: vision width x 4 (after the shuffle) -> language width."""
        lm = self.language.transformer_config()
        return TransformerConfig(
            num_layers=1,
            hidden_size=self.language.hidden_size,
            num_attention_heads=1,
            ffn_hidden_size=self.language.hidden_size,
            **{k: getattr(lm, k) for k in _SHARED_SETTINGS},
        )


_SHARED_SETTINGS = ("use_cpu_initialization", "bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
                    "gradient_accumulation_fusion", "persist_layer_norm", "attention_dropout", "hidden_dropout",
                    "calculate_per_token_loss", "apply_rope_fusion")


def vision_layer_spec() -> ModuleSpec:
    """megatron-core's local ViT layer with bidirectional attention (its 0.16.1 default is causal)."""
    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.params = {**spec.submodules.self_attention.params, "attn_mask_type": AttnMaskType.no_mask}
    return spec


class TinyVLM(torch.nn.Module):
    """Vision tower + pixel shuffle + projector + GPT; `encode` and `language` run apart (the runtime moves
    the image embeddings between them)."""

    def __init__(self, config: TinyVLMConfig, *, language_spec: ModuleSpec | None = None,
                 pg_collection: ProcessGroupCollection | None = None, seed: int = 0) -> None:
        super().__init__()
        pgs = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        if pgs.tp.size() != 1 or pgs.pp.size() != 1:
            raise DhpError(f"the vision-language model runs with TP 1 and PP 1 (got TP {pgs.tp.size()}, PP "
                           f"{pgs.pp.size()}); its tower is replicated over the domain")
        self.vlm_config = config
        vision = config.vision_config()
        self.vision = CLIPViTModel(vision, vision_layer_spec(), add_class_token=False, class_token_len=0,
                                   patch_dim=config.tower.patch_px, img_h=config.tower.tile_px, img_w=config.tower.tile_px,
                                   model_subtype="internvit", pg_collection=pgs)
        mlp = get_vit_layer_with_local_spec().submodules.mlp.submodules
        self.projector = MultimodalProjector(config.projector_config(), mlp, "mlp",
                                             input_size=round(config.tower.hidden_size / PIXEL_SHUFFLE**2),
                                             tp_group=pgs.tp)
        self.language = build_tiny_gpt(config.language, spec=language_spec, pg_collection=pgs, seed=seed)
        self.config = self.language.config
        """The language model's TransformerConfig (what megatron's DDP and the step runner read)."""
        init_weights_(self.vision, seed=seed + 1)
        init_weights_(self.projector, seed=seed + 2)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        """A batch without images is the language model's alone (GPTModel's arguments)."""
        return self.language(*args, **kwargs)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [k, 3, tile_px, tile_px] -> their LLM-token embeddings [k x tokens_per_tile, hidden], tile by tile
        (each tile attends only within itself, so tiles of many images encode together)."""
        if pixels.shape[0] == 0:
            return pixels.new_zeros(0, self.config.hidden_size)
        patches = self.vision(pixels)  # [k, patches, vision hidden]: attention inside each tile only
        merged = pixel_shuffle(patches, scale_factor=PIXEL_SHUFFLE)
        out = self.projector(merged.transpose(0, 1).contiguous())  # [tokens, k, hidden]
        return out.transpose(0, 1).reshape(-1, out.shape[-1])

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, image_rows: torch.Tensor,
              image_embeddings: torch.Tensor) -> torch.Tensor:
        """The language model's input [s, 1, hidden]: word embeddings, with rows `image_rows` replaced by the
        image embeddings (one per row, in that order)."""
        words = self.language.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, 1, h]
        if image_rows.numel() == 0:
            return words
        return words.index_put((image_rows, torch.zeros_like(image_rows)), image_embeddings)



def random_vlm_samples(batch: Batch, config: TinyVLMConfig, *, seed: int, max_images: int = 2,
                       max_tiles: int = 3) -> list[TokenSample]:
    """Token ids and images for `batch`: each sample gets 0..max_images images of 1..max_tiles tiles (random
    pixels) where its length leaves room, at random places. As in LLaVA's `_preprocess_data`, an image's
    positions hold a placeholder id and have no loss, and neither has the token before it (its label would be
    the image)."""
    gen = torch.Generator().manual_seed(seed)
    tower = config.tower
    per_tile = tower.tokens_per_tile

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=gen))

    out = []
    for s in batch.samples:
        tokens = torch.randint(1, config.language.vocab_size, (s.tokens + 1,), generator=gen)
        mask = torch.ones(s.tokens)
        images, cursor = [], 0
        for _ in range(draw(max_images + 1)):
            tiles = 1 + draw(max_tiles)
            room = s.tokens - cursor - tiles * per_tile
            if room < 0:
                break
            start = cursor + draw(room + 1)
            pixels = torch.randn(tiles, 3, tower.tile_px, tower.tile_px, generator=gen)
            images.append(ImageInput(start, tiles * per_tile, tiles * tower.patches_per_tile, pixels))
            tokens[start:start + tiles * per_tile] = IMAGE_PLACEHOLDER
            mask[max(start - 1, 0):start + tiles * per_tile] = 0
            cursor = start + tiles * per_tile
        out.append(TokenSample(s.id, tokens[:-1], tokens[1:], mask, tuple(images)))
    return out
