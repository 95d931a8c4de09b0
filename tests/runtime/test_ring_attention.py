"""Ring attention in O(one block): exact against one process, and what it keeps for backward is flat in the group.

The ring's forward keeps q, its own k/v, the merged output and log-sum-exp; its backward sends K/V around the
ring again with their gradient accumulators. The kernels alone are checked on virtual groups in
`test_attention_kernels.py` (no process group).
"""

from __future__ import annotations

import pytest

from megatron_dhp.launch.ranks import launch
from tests.numerics import RELATIVE
from tests.runtime import ring_workers


@pytest.fixture(scope="module")
def exactness() -> list[dict]:
    """Several documents (one shorter than the group), GQA 4/2, groups of 2 and 3."""
    return launch(ring_workers.ring_against_one_process, 3, (37, 2, 90, 11), 4, 2, timeout_s=300)


@pytest.mark.parametrize("comm", ["ring", "p2p"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("size", [2, 3])
def test_ring_output_and_gradients_equal_one_process(exactness, size, backend, comm):
    """fp32, relative 1e-5, on every rank of the group: output, dq, dk, dv (the backward re-sends K/V with dK/dV), over
    the group's communicator (`ring`) or a PeerRing on the world's (`p2p`, rank 2 idle in the group of 2)."""
    for rank in exactness[:size]:
        assert max(rank[size, backend, comm]) <= RELATIVE, rank[size, backend, comm]


@pytest.fixture(scope="module")
def narrow_values() -> list[dict]:
    """As `exactness`, with MLA's shape: values 5 wide against queries and keys 8 wide, every variant."""
    return launch(ring_workers.ring_against_one_process, 3, (37, 2, 90, 11), 4, 2, 5,
                  ("allgather", "ring", "ulysses", "p2p"), timeout_s=300)


@pytest.mark.parametrize("comm", ["allgather", "ring", "ulysses", "p2p"])
@pytest.mark.parametrize("size", [2, 3])
def test_every_variant_is_exact_with_values_narrower_than_keys(narrow_values, size, comm):
    """MLA's V head is narrower than its Q/K head (128 against 192): the ring sends K and V side by side, the
    CPU's fused kernels get V padded; fp32, relative 1e-5, sdpa and math."""
    for rank in narrow_values[:size]:
        for backend in ("sdpa", "math"):
            assert max(rank[size, backend, comm]) <= RELATIVE, (backend, rank[size, backend, comm])


def test_ring_keeps_the_same_bytes_for_backward_at_every_group_size_while_allgather_grows():
    """4096 tokens per rank on one long sample, groups of 1 to 4 ranks: ring saves q, k, v, out and lse only."""
    per_rank = launch(ring_workers.saved_bytes_per_rank, 4, 4096, 2, timeout_s=300)
    sizes = (1, 2, 3, 4)
    for size in sizes:
        assert len({(r[size, "ring"], r[size, "allgather"]) for r in per_rank[:size]}) == 1, per_rank
    ring = [per_rank[0][size, "ring"] for size in sizes]
    allgather = [per_rank[0][size, "allgather"] for size in sizes]
    assert ring == [ring[0]] * 4, ring
    assert ring[0] == 4096 * 2 * ring_workers.HEAD_DIM * 4 * 4 + 4096 * 2 * 4  # q, k, v, out fp32, lse fp32
    assert all(a < b for a, b in zip(allgather, allgather[1:])), allgather
    assert allgather[3] > 2 * ring[3], (allgather, ring)
