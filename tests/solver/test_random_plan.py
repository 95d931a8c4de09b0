"""Random plans: always valid, reproducible, and adversarial enough to exercise the runtime."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dhp.cost.config import Domain
from megatron_dhp.errors import DhpError
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload.sample import Batch


def test_random_plans_are_valid_reproducible_and_varied():
    domain = Domain(world_size=6, gpus_per_node=6, max_tokens_per_rank=32)
    sizes, phases, idle_groups, non_contiguous = set(), set(), 0, 0
    for seed in range(60):
        rng = random.Random(seed)
        batch = Batch.from_lengths([rng.randint(1, 100) for _ in range(10)])
        plan = random_plan(batch, domain, rng)
        plan.validate()
        assert plan.fingerprint() == random_plan(batch, domain, _replay(seed)).fingerprint()
        sizes |= {g.size for g in plan.groups}
        phases.add(plan.num_phases)
        idle_groups += sum(not g.microbatches for g in plan.groups)
        non_contiguous += sum(list(g.ranks) != list(range(g.ranks[0], g.ranks[0] + g.size)) for g in plan.groups)
    assert {3, 5}.issubset(sizes) and sizes <= set(range(1, 7))
    assert {1, 2} <= phases and idle_groups > 0 and non_contiguous > 0


def _replay(seed: int) -> random.Random:
    """The generator state random_plan saw in the loop above (after drawing the batch)."""
    rng = random.Random(seed)
    [rng.randint(1, 100) for _ in range(10)]
    return rng


def test_sample_longer_than_the_domain_is_a_clear_error():
    with pytest.raises(DhpError, match="sample 1 has 300 tokens"):
        random_plan(Batch.from_lengths([5, 300]), Domain(2, 2, 100), random.Random(0))


def test_random_plan_imports_without_torch():
    """Planning code: the selftest's adversary is built where no torch (or megatron-core) is loaded."""
    code = "import sys, megatron_dhp.solver.random_plan; print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[2])
    assert result.stdout.strip() == "[]", result.stdout
