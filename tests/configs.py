"""The shared cost configs of the tests, loaded once: frozen dataclasses, so every test may share them. Tests
take them as fixtures (tests/conftest.py); a module that needs one at import time (a parametrize list, a
module constant) imports it from here."""

from __future__ import annotations

from megatron_dhp.cost import CostConfig

GPT7B = CostConfig.load("gpt7b-64")
"""GPT-7B's coefficients on 64 ranks of 8 per node (configs/gpt7b-64.yaml)."""
