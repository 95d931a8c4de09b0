"""The vision-language runtime: an InternVL-shaped megatron-core model trained on dynamic groups, its images
encoded under each placement, loss and every gradient (vision tower and projector included) equal to one
process; the encoder attends within a tile and in both directions."""

from __future__ import annotations

import pytest
import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.launch.ranks import launch
from megatron_dhp.plan.comm import COMM_VARIANTS
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.step_data import GatheredImage, ImageInput, TokenSample
from megatron_dhp.runtime.vision import encoder_ranks
from megatron_dhp.workload.sample import Batch
from tests.numerics import RELATIVE
from tests.runtime import vlm_workers


@pytest.fixture(scope="module")
def four() -> dict:
    return launch(vlm_workers.vlm_checks, 4, timeout_s=500)[0]


def test_every_placement_and_comm_matches_one_process(four):
    assert four["images"] >= 4
    assert len(four["exact"]) == 2 * len(CONCRETE_PLACEMENTS) * len(COMM_VARIANTS)
    for key, result in four["exact"].items():
        assert result.max_loss_diff <= RELATIVE and result.max_grad_diff <= RELATIVE, (key, result)
        assert result.tokens_computed == result.batch_tokens and result.ok, (key, result)
    # the comparison covered a vision tower that really learned: its gradient is far above what it tolerates
    assert four["vision_grad"] > 100 * RELATIVE, four["vision_grad"]


def test_the_gathered_batch_the_planner_sees_carries_every_image(four):
    assert four["planned"] == four["given"] and sum(map(len, four["planned"].values())) == four["images"]


def test_the_encoder_attends_within_a_tile_in_both_directions():
    (cross, backward), = launch(vlm_workers.tile_independence, 1, timeout_s=200)
    # Both relative to the tile's largest value (3.8). Another tile in the batch changes only rounding: two tiles
    # change the GEMM shapes (depth 32 to 147), fp32 a few ulps each: 2.8e-7 to 3.8e-7 on a Xeon's kernels, 0 on
    # an EPYC's. A tile that saw the other would move as far as one changed patch moves it (below).
    assert cross <= RELATIVE, cross
    # the last patch reaches the first token: not causal (megatron-core 0.16.1's ViT spec is); 1.2e-2 measured
    assert backward > 100 * RELATIVE, backward


def _image(sid: int, index: int, tiles: int, owner: int) -> GatheredImage:
    return GatheredImage(sid, index, 0, 4 * tiles, 16 * tiles, tiles, (3, 28, 28), owner)


def test_encoder_ranks_per_placement():
    batch = Batch.from_lengths([40, 40, 40])
    plan = Plan("t", 4, 4, batch.samples, (PlanGroup((0, 1, 2), ((0, 1),)), PlanGroup((3,), ((2,),))))
    images = [_image(0, 0, 3, 0), _image(0, 1, 1, 0), _image(1, 0, 2, 1), _image(2, 0, 1, 2)]
    split = encoder_ranks(plan, images, "split")
    assert split == {(0, 0): (0,), (1, 0): (1,), (0, 1): (2,), (2, 0): (3,)}  # longest first, least loaded
    assert encoder_ranks(plan, images, "replicate")[0, 0] == (0, 1, 2)
    assert encoder_ranks(plan, images, "global") == {(0, 0): (0,), (1, 0): (1,), (0, 1): (2,), (2, 0): (3,)}
    with pytest.raises(DhpError, match="encoder placement 'auto' is unknown"):
        encoder_ranks(plan, images, "auto")


@pytest.mark.parametrize("start,llm,pixels,match", [
    (8, 8, torch.zeros(1, 3, 28, 28), "inside the sample's 12 tokens"),
    (-1, 4, torch.zeros(1, 3, 28, 28), "inside the sample"),
    (0, 4, torch.zeros(3, 28, 28), "pixels \\[tiles >= 1, 3, h, w\\]"),
])
def test_a_bad_image_is_a_clear_error(start, llm, pixels, match):
    ids = torch.zeros(12, dtype=torch.int64)
    with pytest.raises(DhpError, match=match):
        TokenSample(0, ids, ids, torch.ones(12), (ImageInput(start, llm, 16, pixels),))
