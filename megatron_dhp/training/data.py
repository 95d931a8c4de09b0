"""The training data: long-tailed sample lengths filled with tokens a small model can learn.

Batch k of a run is a pure function of (seed, k): its lengths come from the configured length source
(scaled, then checked against or cut to the domain's capacity), and every sample's tokens come from a
generator seeded with (seed, k, sample id). So the data position of a run is just the step index, any rank
count sees the same batches, and a rank only ever builds the samples of its own Megatron slice.

The tokens walk a fixed random successor table (a first-order Markov chain drawn from the seed); with
probability `noise` a step jumps to a uniform token instead. The next token is then predictable most of the
time, so the loss falls from ln(vocab) towards the chain's entropy as the model learns the table.

With a vision tower (`vision`), a multimodal source's images become tiles of the model: an item of Q LLM
tokens is round(Q x length_scale / tokens_per_tile) tiles (at least one), each one block of
`patches_per_tile` encoder tokens, with random pixels, at random places between the text; image positions
hold the placeholder id, and they and the token before each image carry no loss (LLaVA's rule). Without
a tower the images are dropped and their tokens stay text.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from megatron_dhp.models.vlm import IMAGE_PLACEHOLDER, VisionTowerConfig
from megatron_dhp.runtime.step_data import ImageInput, TokenSample
from megatron_dhp.training.config import DataConfig
from megatron_dhp.workload.batches import LengthSource, fit_to_domain
from megatron_dhp.workload.sample import Batch, Sample, VisualItem
from megatron_dhp.workload.synthetic import DISTRIBUTIONS


class TokenPipeline:
    """Deterministic global batches (lengths) and the token content of any of their samples."""

    def __init__(self, config: DataConfig, *, vocab_size: int, capacity: int, truncate: bool = False,
                 vision: VisionTowerConfig | None = None) -> None:
        self.config = config
        self.vision = vision
        self.vocab_size = vocab_size
        self.capacity = capacity
        """The longest sample the domain holds (N x M): longer ones are an error unless `truncate`."""
        self.truncate = truncate
        if config.source in DISTRIBUTIONS:
            self.source = LengthSource.from_args(dist=config.source)
        else:
            self.source = LengthSource.from_args(lengths=config.source)
        successors = np.random.default_rng([config.seed, 0x5EED]).permutation(vocab_size)
        self._successor = successors.astype(np.int64)

    def batch(self, step: int) -> Batch:
        """The lengths of the global batch of step `step` (0-based); sample ids are positions in it."""
        drawn = self.source.draw(global_batch=self.config.global_batch, seed=self.config.seed, index=step,
                                 capacity=self.capacity)
        if self.vision is not None:
            drawn = Batch(tuple(self._with_tiles(s) for s in drawn.samples), seed=drawn.seed)
        elif self.config.length_scale != 1.0 or any(s.images for s in drawn.samples):
            scale = self.config.length_scale
            drawn = Batch(tuple(replace(s, tokens=max(1, round(s.tokens * scale)), images=()) for s in drawn.samples),
                          seed=drawn.seed)
        return fit_to_domain(drawn, self.capacity, truncate=self.truncate)

    def _with_tiles(self, sample: Sample) -> Sample:
        """`sample` scaled, its images as whole tiles of the vision tower (see the module doc)."""
        scale, vision = self.config.length_scale, self.vision
        text = max(1, round((sample.tokens - sum(item.llm for item in sample.images)) * scale))
        items = []
        for item in sample.images:
            tiles = max(1, round(item.llm * scale / vision.tokens_per_tile))
            items.append(VisualItem(tiles * vision.patches_per_tile, tiles * vision.tokens_per_tile,
                                    (vision.patches_per_tile,) * tiles))
        return replace(sample, tokens=text + sum(item.llm for item in items), images=tuple(items))

    def local_samples(self, step: int, position: int, size: int) -> list[TokenSample]:
        """The samples domain position `position` of `size` starts step `step` with (Megatron's slice)."""
        samples = self.batch(step).samples
        return [self.token_sample(step, s) for s in samples[position::size]]

    def token_sample(self, step: int, sample: Sample) -> TokenSample:
        """Inputs, next-token labels and a full loss mask for one sample of step `step`."""
        rng = np.random.default_rng([self.config.seed, step + 1, sample.id])
        n = sample.tokens + 1
        jumps = rng.random(n) < self.config.noise
        uniform = rng.integers(0, self.vocab_size, n)
        tokens = np.empty(n, dtype=np.int64)
        tokens[0] = uniform[0]
        successor = self._successor
        for i in range(1, n):
            tokens[i] = uniform[i] if jumps[i] else successor[tokens[i - 1]]
        mask = np.ones(sample.tokens, dtype=np.float32)
        images = []
        if sample.images:  # image k follows the first offsets[k] text tokens
            offsets = np.sort(rng.integers(0, sample.tokens - sum(item.llm for item in sample.images) + 1,
                                           len(sample.images)))
            before = 0
            for offset, item in zip(offsets.tolist(), sample.images):
                start = offset + before
                pixels = rng.standard_normal((len(item.blocks), 3, self.vision.tile_px, self.vision.tile_px),
                                             dtype=np.float32)
                images.append(ImageInput(start, item.llm, item.enc, torch.from_numpy(pixels)))
                tokens[start:start + item.llm] = IMAGE_PLACEHOLDER
                mask[max(start - 1, 0):start + item.llm] = 0
                before += item.llm
        ids = torch.from_numpy(tokens)
        return TokenSample(sample.id, ids[:-1].clone(), ids[1:].clone(), torch.from_numpy(mask), tuple(images))

    def longest(self, steps: int) -> int:
        """The longest sample of the run's first `steps` batches: what a static CP size must hold."""
        return max(int(self.batch(k).lengths.max()) for k in range(steps))
