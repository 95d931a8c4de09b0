"""The `dhp` section under Bridge's own config machinery (megatron-bridge 0.6.2, in this process, no training):
Hydra-style overrides, a recipe YAML's `dhp:` section, and the config YAML Bridge saves and loads back.
Skipped, naming the missing module, where Bridge cannot be imported."""

from __future__ import annotations

import pytest
import yaml

from tests.bridge.cpu_harness import require_bridge

require_bridge()

from megatron.bridge.training.utils.omegaconf_utils import OverridesError, process_config_with_overrides  # noqa: E402

from megatron_dhp.bridge import DhpConfig, bridge_args, dhp_of, validate, with_dhp  # noqa: E402
from megatron_dhp.bridge.container import DhpConfigContainer  # noqa: E402
from megatron_dhp.errors import DhpError  # noqa: E402
from tests.bridge import workers  # noqa: E402


@pytest.fixture
def config() -> DhpConfigContainer:
    return with_dhp(workers.recipe(), DhpConfig(max_tokens_per_rank=48))


def test_overrides_reach_the_runs_dhp_config(config):
    process_config_with_overrides(config, cli_overrides=["dhp.max_tokens_per_rank=4096", "dhp.rank_speeds=[1.0,0.5]",
                                                         "train.train_iters=7"])
    # the DhpConfig the hooks read (Bridge's overrides leave lists where DhpConfig keeps tuples)
    assert bridge_args(config).dhp_config == DhpConfig(max_tokens_per_rank=4096, rank_speeds=(1.0, 0.5))
    assert config.train.train_iters == 7


def test_a_bad_override_is_refused_by_key(config):
    process_config_with_overrides(config, cli_overrides=["dhp.max_tokens_per_rank=0"])
    with pytest.raises(DhpError, match="^dhp: max_tokens_per_rank = 0 must be >= 1"):
        validate(config)
    with pytest.raises(DhpError, match="^dhp: max_tokens_per_rank = 0"):
        config.validate()  # Bridge's own validation checks the section too
    with pytest.raises(OverridesError, match="max_tokens"):  # a key DhpConfig does not have
        process_config_with_overrides(config, cli_overrides=["dhp.max_tokens=1"])


def test_a_recipe_yaml_dhp_section_loads_into_it(config, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("dhp:\n  max_tokens_per_rank: 2048\n  planner: static\n  slow_ranks: ['1:2.0']\n"
                      "train:\n  train_iters: 9\n")
    process_config_with_overrides(config, config_filepath=str(recipe))
    assert dhp_of(config) == DhpConfig(max_tokens_per_rank=2048, planner="static", slow_ranks=("1:2.0",))
    assert config.train.train_iters == 9


def test_the_saved_config_holds_the_dhp_section_and_loads_back_equal(config, tmp_path):
    config.dhp.rank_speeds = (1.0, 0.5)
    saved = tmp_path / "run_config.yaml"
    config.to_yaml(str(saved))  # what Bridge writes beside each checkpoint
    section = yaml.safe_load(saved.read_text())["dhp"]
    assert section["max_tokens_per_rank"] == 48 and section["rank_speeds"] == [1.0, 0.5]
    loaded = DhpConfigContainer.from_yaml(str(saved))
    assert dhp_of(loaded) == dhp_of(config) == DhpConfig(max_tokens_per_rank=48, rank_speeds=(1.0, 0.5))
    assert loaded.train.train_iters == config.train.train_iters


def test_with_dhp_shares_the_recipes_sections():
    recipe = workers.recipe()
    config = with_dhp(recipe, DhpConfig(max_tokens_per_rank=48))
    assert isinstance(config, DhpConfigContainer) and config.model is recipe.model and config.train is recipe.train
    assert dhp_of(with_dhp(config, DhpConfig(max_tokens_per_rank=96))).max_tokens_per_rank == 96
    assert dhp_of(with_dhp(recipe)) == DhpConfig()
