"""megatron-dhp: dynamic hybrid parallelism for Megatron-Core."""

from pathlib import Path

from setuptools import Extension, find_packages, setup

ROOT = Path(__file__).parent

# What a Megatron-LM checkout's `import megatron.training.training` needs beyond megatron-core on a CPU
# machine (core_v0.16.1, Python 3.11): the tokenizers import six and regex, the config dataclasses pydantic,
# checkpoint saving psutil.
MEGATRON_LM = ["six>=1.16,<2", "regex>=2023.10", "pydantic>=2.5,<3", "psutil>=5.9"]

setup(
    name="megatron-dhp",
    version="0.1.0",
    description="Dynamic hybrid (data x context) parallelism for Megatron-Core: per-step groups of any size",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dhp", "megatron_dhp.*"]),
    package_data={"megatron_dhp": ["workload/data/*"]},
    # dhp's draft loops in C (megatron_dhp/solver/dhp/native.py); optional: without a compiler the same
    # Python runs. No FMA contraction, so every sum rounds as the Python's does.
    ext_modules=[Extension("megatron_dhp.solver.dhp._draft", ["csrc/solver/draft.c"],
                           extra_compile_args=["-O2", "-ffp-contract=off"], optional=True)],
    data_files=[
        ("share/megatron-dhp/configs", [str(p) for p in sorted(Path("configs").glob("*.yaml"))]),
    ],
    install_requires=[
        # Bounded so that a CPU machine with the local torch 2.13 CPU wheel does not pull a CUDA build.
        "torch>=2.6,<2.14",
        "megatron-core>=0.16.1",
        "triton",  # megatron.core imports it unconditionally; installs without a GPU
        "numpy>=1.24",
        "highspy>=1.7",
        "pyyaml>=6",
        "matplotlib>=3.7",
        "rich>=13",
    ],
    extras_require={
        "megatron": MEGATRON_LM,
        # tensorboard: the tests read back the event file dhp's scalars go to (docs/megatron-lm.md#what-dhp-logs)
        "dev": ["pytest>=8.3", "hypothesis>=6", "ruff>=0.5", "tensorboard>=2.14", *MEGATRON_LM],
        "gpu": ["transformer-engine[pytorch]", "flash-attn>=2.1"],  # 2.1: bottom-right causal masks
        # megatron_dhp.bridge (Python 3.12; nothing on older Pythons): what megatron-bridge 0.6.2's pretraining path and
        # its overrides import, at Bridge's bounds. Not Bridge itself, which is installed with --no-deps
        # (docs/bridge.md#install): its requirements include fast-hadamard-transform, an sdist whose build needs
        # torch and CUDA, and transformer-engine, flashinfer and more through megatron-core[dev].
        "bridge": [f'{r}; python_version >= "3.12"' for r in (
            "megatron-core==0.19.0", "transformers>=5.8,<=5.12.1", "einops", "omegaconf>=2.3.0", "hydra-core>=1.3.4,<1.4",
            "datasets>=2.20.0", "megatron-energon~=7.0", "nvidia-modelopt>=0.44", "diffusers>=0.36.0", "requests",
            "tensorboard>=2.19.0")],
    },
    entry_points={"console_scripts": ["megatron-dhp=megatron_dhp.cli:main"]},
)
