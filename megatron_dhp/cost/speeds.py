"""Rank speeds a user states up front: a JSON file of one relative speed per rank, or per node in a config.

A speed is relative to the rank the cost model's coefficients describe (1.0); a throttled or older GPU is
below 1. `Domain.rank_speeds` holds them; the closed loop (`closed_loop`) measures them during training instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megatron_dhp.config_io import load_json_file
from megatron_dhp.cost.config import check_speeds
from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.files import SPEEDS_BYTES


def load_rank_speeds(path: str | Path) -> tuple[float, ...]:
    """The JSON list of relative speeds in `path` (one per domain position; checked against the domain when
    the cost config takes them)."""
    speeds = load_json_file(path, what="rank speeds file", limit=SPEEDS_BYTES)
    if not isinstance(speeds, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in speeds):
        raise DhpError(f"rank speeds file {str(path)!r} must hold a JSON list of numbers, one per rank "
                       "(such as [1.0, 1.0, 0.5, 1.0])")
    return tuple(float(v) for v in speeds)


def expand_speeds(rank_speeds: Sequence[float], node_speeds: Sequence[float], world_size: int,
                  gpus_per_node: int) -> tuple[float, ...]:
    """Per-rank speeds from a config that gives them per rank or per node (not both); empty when neither."""
    if rank_speeds and node_speeds:
        raise DhpError("give rank_speeds or node_speeds, not both")
    if node_speeds:
        nodes = -(-world_size // gpus_per_node)
        if len(node_speeds) != nodes:
            raise DhpError(f"node_speeds holds {len(node_speeds)} speeds but the domain of {world_size} ranks spans "
                           f"{nodes} nodes of {gpus_per_node}; give one speed per node")
        rank_speeds = [node_speeds[r // gpus_per_node] for r in range(world_size)]
    speeds = tuple(float(v) for v in rank_speeds)
    check_speeds(speeds, world_size)
    return speeds


def parse_slowdowns(items: Sequence[str]) -> dict[int, float]:
    """`RANK:FACTOR` items (fault injection: that global rank holds each slot FACTOR times as long) as a dict."""
    out: dict[int, float] = {}
    for item in items:
        rank, _, factor = item.partition(":")
        try:
            out[int(rank)] = float(factor)
        except ValueError:
            raise DhpError(f"slow rank {excerpt(item)} must be RANK:FACTOR, such as 1:2.0") from None
        if int(rank) < 0 or not out[int(rank)] >= 1.0:
            raise DhpError(f"slow rank {excerpt(item)}: the rank must be >= 0 and the factor >= 1.0 (2.0: half speed)")
    return out
