"""megatron-dhp under megatron-bridge 0.6.2: the example recipe's per-step losses on 2 gloo CPU ranks with dhp equal
Bridge's own run of the same recipe with every sample on one rank (relative 2e-6).

The recipe's 64-token sequences exceed `max_tokens_per_rank` 48, so every sequence runs as context parallelism over
a dynamic group of both ranks. Skipped where megatron-bridge is not installed (CI: Python 3.11, no Bridge).
"""

from __future__ import annotations

import pytest

from tests.bridge.cpu_harness import require_bridge

require_bridge()  # skipped, naming the missing module, where Bridge cannot be imported

from megatron_dhp.launch.ranks import launch  # noqa: E402
from tests.bridge import workers  # noqa: E402

TOLERANCE = 2e-6
DHP = {"max_tokens_per_rank": 48}


def _relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def bridge_alone() -> list[float]:
    return launch(workers.train, 1, timeout_s=550)[0]["train"]


@pytest.fixture(scope="module")
def saved_config(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("bridge") / "config.yaml")


@pytest.fixture(scope="module")
def with_dhp(saved_config) -> list[dict]:
    return launch(workers.train, 2, DHP, None, saved_config, timeout_s=550)


def test_losses_with_dhp_equal_bridge_alone(bridge_alone, with_dhp):
    assert len(bridge_alone) == workers.SIZES["train_iters"]
    for rank in with_dhp:
        assert _relative(rank["train"], bridge_alone) <= TOLERANCE, (rank["train"], bridge_alone)


def test_the_run_config_bridge_saves_loads_back_with_the_dhp_section(with_dhp, saved_config):
    # written by Bridge's setup while dhp's layer spec is in place: it records Bridge's own spec, which loads
    from megatron_dhp.bridge import DhpConfig, dhp_of
    from megatron_dhp.bridge.container import DhpConfigContainer

    loaded = DhpConfigContainer.from_yaml(saved_config)
    assert dhp_of(loaded) == DhpConfig(**DHP)
    assert loaded.model.transformer_layer_spec is workers.recipe().model.transformer_layer_spec


# layout -> (Bridge's own ranks, dhp's ranks, recipe changes, DhpConfig keys): Bridge alone runs every sample on
# one model replica; dhp on a domain of 2 per model-parallel coordinate, sequences on CP groups of 2 (under PP a
# rank holds M // 2 per microbatch, so M = 64 puts each 64-token sequence on both ranks of its stage)
LAYOUTS = {
    "pp2": (2, 4, {"pipeline_parallel": 2}, {"max_tokens_per_rank": 64}),
    "tp2": (2, 4, {"tensor_parallel": 2}, DHP),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_with_dhp_equal_bridge_alone_under_model_parallelism(layout):
    """Bridge's own pipeline (megatron-core's 1F1B over the plan's slots) and tensor parallelism under dhp."""
    alone_ranks, dhp_ranks, changes, dhp = LAYOUTS[layout]
    alone = launch(workers.train, alone_ranks, None, changes, timeout_s=550)
    with_dhp = launch(workers.train, dhp_ranks, dhp, changes, timeout_s=550)
    want = next(r["train"] for r in alone if r["train"])  # the last pipeline stage reports the loss
    got = [r["train"] for r in with_dhp if r["train"]]
    assert got and all(_relative(g, want) <= TOLERANCE for g in got), (got, want)


def test_a_mis_set_recipe_changes_the_losses(bridge_alone):
    # the comparison can fail: the same dhp run at twice the learning rate moves the losses after the first step
    mis_set = launch(workers.train, 2, DHP, {"lr": 2 * workers.SIZES["lr"]}, timeout_s=550)[0]["train"]
    assert _relative(mis_set[:1], bridge_alone[:1]) <= TOLERANCE
    assert _relative(mis_set[1:], bridge_alone[1:]) > 100 * TOLERANCE, (mis_set, bridge_alone)


def test_refusals_name_the_container_field_and_the_fix():
    from megatron_dhp.bridge import DhpConfig, validate, with_dhp
    from megatron_dhp.errors import DhpError

    cfg = with_dhp(workers.recipe(), DhpConfig())
    cfg.model.context_parallel_size = 2
    cfg.dist.use_decentralized_pg = True
    with pytest.raises(DhpError) as e:
        validate(cfg)
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("dist.use_decentralized_pg with dhp:") and "set dist.use_decentralized_pg = False" in lines[0]
    assert lines[1].startswith("model.context_parallel_size 2 with dhp:") and "model.context_parallel_size 1" in lines[1]


def test_a_recipe_without_the_dhp_section_is_refused():
    from megatron_dhp.bridge import validate
    from megatron_dhp.errors import DhpError

    with pytest.raises(DhpError, match="with_dhp"):
        validate(workers.recipe())
