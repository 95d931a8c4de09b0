"""What the vision-language runtime tests run on every spawned rank (importable, results picklable)."""

from __future__ import annotations

import torch

from megatron_dhp.models.vlm import TinyVLMConfig, random_vlm_samples
from megatron_dhp.plan.comm import COMM_VARIANTS
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.runtime.collectives import gather_batch
from megatron_dhp.runtime.step_data import local_slice
from tests.numerics import RelativeSelfCheck, largest_abs, relative, relative_diff
from tests.ranks import start_cpu_rank
from tests.runtime.dist_workers import batch, plans_of_four

SEED = 11


def vlm_checks() -> dict:
    """Every plan of four ranks (groups of 1-4, non-contiguous, idle rank, barrier) under every encoder
    placement and comm variant, against one process; and the vision tower's gradient on the oracle's scale,
    to show it trained."""
    start_cpu_rank()
    config = TinyVLMConfig()
    check = RelativeSelfCheck(vlm=config, seed=SEED)
    samples = random_vlm_samples(batch(), config, seed=SEED)
    out: dict = {"images": sum(len(s.images) for s in samples), "exact": {}}
    gathered = gather_batch(local_slice(samples, check.domain.position, check.domain.size), check.domain)
    out["planned"] = {s.id: [(i.enc, i.llm, i.blocks) for i in s.images] for s in gathered.batch.samples}
    out["given"] = {s.id: [(im.enc_tokens, im.llm_tokens, (config.tower.patches_per_tile,) * im.tiles) for im in s.images]
                    for s in samples}
    for name, plan in plans_of_four().items():
        for placement in CONCRETE_PLACEMENTS:
            for comm in COMM_VARIANTS:
                out["exact"][name, placement, comm] = check.check(plan, samples, comm, placement=placement)
    vision = dict(check.model.module.vision.named_parameters())  # the last check's gradients, and its oracle's
    out["vision_grad"] = relative(largest_abs([vision["conv1.weight"].main_grad]),
                                  largest_abs(p.grad for p in check.reference.parameters()))
    return out


def tile_independence() -> tuple[float, float]:
    """One rank: how much a tile's embedding changes, relative to its largest value, when (a) another tile is
    encoded with it, (b) the last patch of its own tile changes (0 up to rounding and > 0 for a per-tile
    bidirectional encoder)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dhp.models.vlm import TinyVLM
    from megatron_dhp.verify.reference import single_rank_groups

    start_cpu_rank()
    config = TinyVLMConfig()
    model = TinyVLM(config, language_spec=get_gpt_layer_local_spec(), pg_collection=single_rank_groups())
    pixels = torch.randn(2, 3, config.tower.tile_px, config.tower.tile_px, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        both, alone = model.encode(pixels), model.encode(pixels[:1])
        changed = pixels.clone()
        changed[0, :, -config.tower.patch_px:, -config.tower.patch_px:] += 1.0
        first = model.encode(changed)
    per_tile = config.tower.tokens_per_tile
    return relative_diff(both[:per_tile], alone), relative_diff(first[0], both[0])
