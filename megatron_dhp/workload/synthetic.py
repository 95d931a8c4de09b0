"""Named length distributions: the real WLB-LLM list and documented synthetic ones.

Every distribution draws `n` samples from a numpy Generator, so a (seed, batch index) pair always gives the
same batch. `megatron-dhp dists` prints each one's parameters and the quantiles it produces.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from megatron_dhp.errors import DhpError
from megatron_dhp.workload.sample import Sample, VisualItem

WLBLLM_PATH = Path(__file__).parent / "data" / "dist_wlbllm.json.gz"


@dataclass(frozen=True)
class Distribution:
    """A named generator of sample lengths (and image token counts for multimodal mixes)."""

    name: str
    description: str
    params: dict = field(default_factory=dict)
    draw_fn: Callable[..., list[Sample]] | None = None

    def draw(self, rng: np.random.Generator, n: int, *, capacity: int) -> list[Sample]:
        """`n` samples with ids 0..n-1; `capacity` (N x M) is the largest sample the domain holds."""
        return self.draw_fn(rng, n, capacity=capacity, **self.params)


def _lognormal(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(np.int64)


def _from_lengths(lengths: np.ndarray) -> list[Sample]:
    return [Sample(i, int(n)) for i, n in enumerate(lengths)]


@cache
def wlbllm_lengths() -> np.ndarray:
    """The 99,519 real document lengths (see workload/data/NOTICE.md)."""
    return np.asarray(json.loads(gzip.decompress(WLBLLM_PATH.read_bytes())), dtype=np.int64)


def _draw_wlbllm(rng: np.random.Generator, n: int, *, capacity: int) -> list[Sample]:
    pool = wlbllm_lengths()
    return _from_lengths(rng.choice(pool, size=n, replace=n > len(pool)))


def _draw_lognormal_pareto(
    rng: np.random.Generator, n: int, *, capacity: int, median: int, sigma: float, tail_prob: float,
    tail_start: int, tail_alpha: float, max_tokens: int,
) -> list[Sample]:
    body = _lognormal(rng, n, median, sigma, 32, tail_start)
    tail = np.minimum(np.rint(tail_start * (1.0 + rng.pareto(tail_alpha, n))), max_tokens).astype(np.int64)
    return _from_lengths(np.where(rng.random(n) < tail_prob, tail, body))


def _draw_bimodal(
    rng: np.random.Generator, n: int, *, capacity: int, long_prob: float, short: tuple[int, int], long: tuple[int, int],
) -> list[Sample]:
    short_len = rng.integers(short[0], short[1] + 1, n)
    long_len = rng.integers(long[0], long[1] + 1, n)
    return _from_lengths(np.where(rng.random(n) < long_prob, long_len, short_len))


def _draw_giant(
    rng: np.random.Generator, n: int, *, capacity: int, giant_fraction: float, median: int, sigma: float,
) -> list[Sample]:
    lengths = _lognormal(rng, n, median, sigma, 32, 8 * median)
    lengths[rng.integers(n)] = max(1, int(giant_fraction * capacity))
    return _from_lengths(lengths)


def _draw_quantiles(
    rng: np.random.Generator, n: int, *, capacity: int, quantiles: tuple[tuple[float, int], ...], shortest: int,
    longest: int,
) -> list[Sample]:
    """Inverse-CDF draws from published percentiles: log(length) linear in -log(1 - p) between them (a power
    law between neighbours, so the tail keeps its shape), from `shortest` at p = 0 linear in p up to the first,
    the last segment's slope beyond the last, cut at `longest` and at the capacity."""
    p = np.array([q[0] for q in quantiles])
    log_len = np.log([q[1] for q in quantiles])
    u_knots, u = -np.log1p(-p), -np.log1p(-rng.random(n))
    out = np.interp(u, u_knots, log_len)
    head = u < u_knots[0]
    out[head] = np.log(shortest) + (log_len[0] - np.log(shortest)) * u[head] / u_knots[0]
    tail = u > u_knots[-1]
    slope = (log_len[-1] - log_len[-2]) / (u_knots[-1] - u_knots[-2])
    out[tail] = log_len[-1] + slope * (u[tail] - u_knots[-1])
    return _from_lengths(np.clip(np.rint(np.exp(out)), shortest, min(longest, capacity)).astype(np.int64))


def _draw_clipped_lognormal(
    rng: np.random.Generator, n: int, *, capacity: int, mean: float, sigma: float, lo: int, hi: int,
) -> list[Sample]:
    return _from_lengths(_lognormal(rng, n, mean * np.exp(-sigma**2 / 2), sigma, lo, min(hi, capacity)))


def _draw_burst(
    rng: np.random.Generator, n: int, *, capacity: int, burst_prob: float, burst: int, filler: tuple[int, int],
) -> list[Sample]:
    lengths = rng.integers(filler[0], filler[1] + 1, n)
    if rng.random() < burst_prob:
        lengths[0] = min(burst, capacity)
    return _from_lengths(lengths)


def _draw_multimodal(
    rng: np.random.Generator, n: int, *, capacity: int, text_median: int, image_prob: float, max_images: int,
    tiled_prob: float, max_tiles: int, video_prob: float, video_frames: tuple[int, int], tile: tuple[int, int],
    frame: tuple[int, int],
) -> list[Sample]:
    """Text plus the visual items of real VLMs: single 448^2 images, InternVL multi-tile images (tiles plus a
    thumbnail, one attention block each) and videos (one block per frame), encoder tokens ~4x LLM tokens."""
    text = _lognormal(rng, n, text_median, 0.8, 16, 16 * text_median)
    kind = rng.random(n)
    n_images = rng.integers(1, max_images + 1, n)
    tiles = rng.integers(1, max_tiles + 1, n)
    frames = rng.integers(video_frames[0], video_frames[1] + 1, n)
    single = VisualItem(tile[0], tile[1])
    samples = []
    for i in range(n):
        if kind[i] < image_prob:
            items = [single] * int(n_images[i])
        elif kind[i] < image_prob + tiled_prob:  # tiles + thumbnail
            blocks = (tile[0],) * (int(tiles[i]) + 1)
            items = [VisualItem(sum(blocks), tile[1] * len(blocks), blocks)]
        elif kind[i] < image_prob + tiled_prob + video_prob:
            blocks = (frame[0],) * int(frames[i])
            items = [VisualItem(sum(blocks), frame[1] * len(blocks), blocks)]
        else:
            items = []
        llm = sum(item.llm for item in items)
        samples.append(Sample(i, int(text[i]) + llm, tuple(items)))
    return samples


DISTRIBUTIONS: dict[str, Distribution] = {
    d.name: d
    for d in (
        Distribution(
            "wlbllm",
            "the real WLB-LLM document lengths (99,519 docs, max 124,913), drawn without replacement",
            {},
            _draw_wlbllm,
        ),
        Distribution(
            "lognormal-pareto",
            "log-normal body (median 2048) with a 3% Pareto tail from 16K up to 128K tokens",
            dict(median=2048, sigma=1.0, tail_prob=0.03, tail_start=16384, tail_alpha=1.2, max_tokens=131072),
            _draw_lognormal_pareto,
        ),
        Distribution(
            "bimodal",
            "85% short documents (128-2K) and 15% long ones (16K-64K), uniform within each mode",
            dict(long_prob=0.15, short=(128, 2048), long=(16384, 65536)),
            _draw_bimodal,
        ),
        Distribution(
            "giant",
            "one sample at 90% of the domain's capacity N x M among short log-normal ones (median 1K)",
            dict(giant_fraction=0.9, median=1024, sigma=0.8),
            _draw_giant,
        ),
        Distribution(
            "wikipedia",
            "FlexSP's Wikipedia lengths (ASPLOS'25), rebuilt from its published percentiles: mean 997 (published "
            "1,014), 79% of documents <= 1K holding 25% of the tokens, p99.99 101K",
            dict(quantiles=((0.10, 87), (0.25, 146), (0.50, 347), (0.75, 862), (0.90, 2112), (0.95, 3720),
                            (0.99, 10919), (0.999, 37353), (0.9999, 101537)), shortest=16, longest=1_820_000),
            _draw_quantiles,
        ),
        Distribution(
            "burst",
            "the DHP paper's synthetic burst: in half the batches one 128K-token sample, among uniform 512-4K fillers",
            dict(burst_prob=0.5, burst=131072, filler=(512, 4096)),
            _draw_burst,
        ),
        Distribution(
            "dcp-lognormal",
            "Megatron-LM's dynamic-CP example (examples/dynamic_context_parallel): log-normal of mean 1024, sigma "
            "1.5, clipped to 128-8192 (mean 907; 26% at 128)",
            dict(mean=1024, sigma=1.5, lo=128, hi=8192),
            _draw_clipped_lognormal,
        ),
        Distribution(
            "multimodal",
            "text (median 384) + 1-4 single 448^2 images (1,024 enc / 256 LLM tokens; 30%), or one image of 1-12 "
            "tiles + thumbnail (25%), or a video of 8-256 frames (784 enc / 196 LLM tokens each; 15%)",
            dict(text_median=384, image_prob=0.30, max_images=4, tiled_prob=0.25, max_tiles=12, video_prob=0.15,
                 video_frames=(8, 256), tile=(1024, 256), frame=(784, 196)),
            _draw_multimodal,
        ),
    )
}


def get_distribution(name: str) -> Distribution:
    """The distribution called `name`, or a clear error listing the names."""
    if name not in DISTRIBUTIONS:
        raise DhpError(f"unknown distribution {name!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[name]
