"""Print docs/configuration.md: every YAML key of every config dataclass, from the dataclasses themselves.

    python scripts/config_docs.py > docs/configuration.md

`tests/test_docs.py` fails when the page and the dataclasses disagree.
"""

from __future__ import annotations

import argparse

from megatron_dhp.config_io import markdown_table
from megatron_dhp.cost import CostConfig
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.training.config import DataConfig, ModelConfig, RunConfig

HEADER = """# Configuration keys

Every configuration is a frozen dataclass with a docstring under each field; YAML files only load into them
(`yaml.safe_load`), an unknown key names the closest valid one, and a value of the wrong type or range stops
with one line naming the key and the file. This page is generated from those dataclasses
(`python scripts/config_docs.py > docs/configuration.md`; a test keeps the two equal). Leave a key out to take
its default.
"""

SECTIONS = (
    ("Cost-model keys", "A cost-model YAML (`configs/gpt7b-64.yaml`, or the output of `megatron-dhp profile`): "
     "`CostConfig` in `megatron_dhp/cost/config.py`. Formulas: [cost-model.md](cost-model.md). `--world-size`, "
     "`--gpus-per-node` and `--max-tokens-per-rank` override the domain keys on the command line.",
     CostConfig, ""),
    ("DHP keys", "A `--dhp-config` YAML of Megatron-LM (`configs/llama3_8b_dhp.yaml`), or the `dhp:` section of a "
     "training config: `DhpConfig` in `megatron_dhp/integration/dhp_config.py`. The `--dhp-*` flags override "
     "the same keys ([megatron-lm.md](megatron-lm.md#flags)).", DhpConfig, ""),
    ("Training keys", "A `megatron-dhp train` / `demo` config (`configs/demo_cpu.yaml`) has four sections: "
     "`model`, `data`, `train` (below) and `dhp` (the DHP keys above). Dataclasses in "
     "`megatron_dhp/training/config.py`.", None, ""),
    ("model", None, ModelConfig, "model."),
    ("data", None, DataConfig, "data."),
    ("train", None, RunConfig, "train."),
)


def page() -> str:
    """The whole page, in section order."""
    parts = [HEADER]
    for title, intro, cls, prefix in SECTIONS:
        level = "###" if prefix else "##"
        parts.append(f"{level} {title}\n")
        if intro:
            parts.append(intro + "\n")
        if cls is not None:
            parts.append(markdown_table(cls, prefix=prefix) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(page(), end="")
