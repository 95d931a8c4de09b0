"""The token pipeline: deterministic batches, Megatron slices, learnable content, scaling and truncation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.training.config import DataConfig
from megatron_dhp.training.data import TokenPipeline


def pipeline(**kw) -> TokenPipeline:
    data = {"source": "wlbllm", "length_scale": 1 / 32, "global_batch": 12, "seed": 5, **kw}
    return TokenPipeline(DataConfig(**data), vocab_size=97, capacity=1024, truncate=True)


def test_batches_depend_only_on_seed_and_step():
    a, b = pipeline(), pipeline()
    assert a.batch(3) == b.batch(3) and a.batch(3) != a.batch(4)
    assert pipeline(seed=6).batch(3) != a.batch(3)
    for x, y in zip(a.local_samples(3, 0, 1), b.local_samples(3, 0, 1)):
        assert torch.equal(x.input_ids, y.input_ids)


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_rank_slices_cover_the_batch_like_megatron(ranks):
    p = pipeline()
    whole = {s.id: s for s in p.local_samples(2, 0, 1)}
    slices = [p.local_samples(2, r, ranks) for r in range(ranks)]
    assert sorted(s.id for part in slices for s in part) == sorted(whole)
    for r, part in enumerate(slices):
        assert [s.id for s in part] == list(range(r, 12, ranks))  # samples r, r+N, r+2N, ...
        for s in part:
            assert torch.equal(s.input_ids, whole[s.id].input_ids)


def test_labels_are_the_next_tokens_and_follow_a_learnable_chain():
    p = pipeline(noise=0.1)
    samples = p.local_samples(0, 0, 1)
    for s in samples:
        assert torch.equal(s.input_ids[1:], s.labels[:-1]) and bool((s.loss_mask == 1).all())
    pairs = torch.cat([torch.stack((s.input_ids, s.labels), 1) for s in samples])
    follows = (torch.from_numpy(p._successor)[pairs[:, 0]] == pairs[:, 1]).float().mean()
    assert 0.85 < float(follows) < 0.95  # 1 - noise of the steps follow the table
    assert int(pairs.max()) < 97


def test_length_scale_and_truncation():
    unscaled = TokenPipeline(DataConfig(global_batch=64, seed=1), vocab_size=8, capacity=10**6).batch(0)
    scaled = TokenPipeline(DataConfig(global_batch=64, seed=1, length_scale=0.01), vocab_size=8,
                           capacity=100, truncate=True).batch(0)
    expected = np.minimum(np.maximum(1, np.rint(unscaled.lengths * 0.01)), 100)
    assert scaled.lengths.tolist() == expected.astype(int).tolist()
    with pytest.raises(DhpError, match="pass --truncate"):
        TokenPipeline(DataConfig(global_batch=64, seed=1, length_scale=0.01), vocab_size=8, capacity=100).batch(0)


def test_longest_is_over_the_run():
    p = pipeline()
    assert p.longest(5) == max(int(p.batch(k).lengths.max()) for k in range(5))


def test_length_file_source(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([5, 9, 30]))
    p = TokenPipeline(DataConfig(source=str(path), global_batch=4), vocab_size=16, capacity=64)
    assert set(p.batch(0).lengths.tolist()) <= {5, 9, 30}
    with pytest.raises(DhpError, match="does not exist"):
        TokenPipeline(DataConfig(source=str(tmp_path / "missing.json")), vocab_size=16, capacity=64)


def test_a_vision_tower_turns_the_images_into_whole_tiles_with_pixels_and_no_loss():
    from megatron_dhp.models.vlm import IMAGE_PLACEHOLDER, VisionTowerConfig

    vision = VisionTowerConfig()
    p = TokenPipeline(DataConfig(source="multimodal", length_scale=1 / 32, global_batch=16, seed=2), vocab_size=97,
                      capacity=4096, truncate=True, vision=vision)
    batch = p.batch(0)
    items = [item for s in batch.samples for item in s.images]
    assert len(items) >= 8
    for item in items:  # each image is k tiles: k blocks of 16 encoder tokens and 4 k LLM tokens
        k = len(item.blocks)
        assert item.blocks == (vision.patches_per_tile,) * k and item.llm == k * vision.tokens_per_tile
    for s, t in zip(batch.samples, p.local_samples(0, 0, 1)):
        assert [(im.llm_tokens, im.enc_tokens, im.tiles) for im in t.images] == \
            [(i.llm, i.enc, len(i.blocks)) for i in s.images]
        for im in t.images:
            rows = slice(im.start, im.start + im.llm_tokens)
            assert bool((t.input_ids[rows] == IMAGE_PLACEHOLDER).all()) and not t.loss_mask[rows].any()
            assert im.start == 0 or t.loss_mask[im.start - 1] == 0  # its label would be the image
            assert im.pixels.shape == (im.tiles, 3, vision.tile_px, vision.tile_px)
        expected = torch.ones(t.length)
        for im in t.images:
            expected[max(im.start - 1, 0):im.start + im.llm_tokens] = 0
        assert torch.equal(t.loss_mask, expected)  # every other token keeps its loss
    text_only = pipeline(source="multimodal").batch(0)  # without a tower the images are dropped
    assert all(not s.images for s in text_only.samples)
