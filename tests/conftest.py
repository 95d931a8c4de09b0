"""Shared fixtures (the preset cost configs and the gpt7b model) and the `slow` tier.

A test is marked `slow` when its function, a fixture it uses, or a function under tests/ that either calls
names `megatron_dhp.launch.ranks.launch` or anything of `subprocess`: it starts ranks or another process. A
module whose tests start ranks in some other way (a command run in-process) sets `pytestmark` itself.
`python -m pytest -q -m "not slow"` runs the rest; `python -m pytest -q` runs everything.

When slow tests are collected, every launch forks its ranks from one server that imported torch,
megatron-core and the package once (`start_ranks_from_fork_server`): a launch then starts in about a second
instead of the ten its ranks take to import them.
"""

from __future__ import annotations

import inspect
import subprocess
import types

import pytest

from megatron_dhp.cost import CostConfig, build_cost_model
from megatron_dhp.launch.ranks import launch, start_ranks_from_fork_server
from tests.configs import GPT7B


def _codes(code: types.CodeType):
    """`code` and every function, lambda and comprehension defined inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _starts_processes(fn, seen: set) -> bool:
    """Whether `fn` names `launch` or `subprocess` (or one of its members), itself or through a function
    defined under tests/ that it names."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    for c in _codes(code):
        for name in c.co_names:
            obj = fn.__globals__.get(name)
            if obj is launch or obj is subprocess or getattr(obj, "__module__", None) == "subprocess":
                return True
            if (isinstance(obj, types.FunctionType) and obj.__module__.partition(".")[0] == "tests"
                    and _starts_processes(obj, seen)):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    verdicts: dict = {}
    for item in items:
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        for fn in (getattr(item, "function", None), *fixtures):
            if fn is not None and fn not in verdicts:
                verdicts[fn] = _starts_processes(fn, set())
            if fn is not None and verdicts[fn]:
                item.add_marker(pytest.mark.slow)
                break


RANK_MODULES = ("torch", "torch.distributed", "megatron.core.models.gpt", "megatron.core.models.multimodal.llava_model",
                "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron_dhp.training.job",
                "megatron_dhp.verify.selfcheck", "megatron_dhp.cli.selftest_cmd")
"""What the ranks of the tests import: the fork server imports them once. (PYTHONWARNINGS as `train` sets it
for its ranks: megatron-core warns at import about TransformerEngine and Apex.)"""


def pytest_collection_finish(session):
    if any(item.get_closest_marker("slow") for item in session.items):
        start_ranks_from_fork_server(RANK_MODULES, env={"PYTHONWARNINGS": "ignore"})


@pytest.fixture(scope="session")
def gpt7b_config() -> CostConfig:
    return GPT7B


@pytest.fixture(scope="session")
def gpt7b(gpt7b_config):
    return build_cost_model(gpt7b_config)


@pytest.fixture(scope="session")
def tiny_cpu_config() -> CostConfig:
    return CostConfig.load("tiny-gpt-cpu")
