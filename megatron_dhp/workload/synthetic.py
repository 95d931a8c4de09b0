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
from megatron_dhp.workload.sample import Sample

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


def _draw_multimodal(
    rng: np.random.Generator, n: int, *, capacity: int, text_median: int, image_prob: float, max_images: int,
    image_tokens: tuple[int, int], video_prob: float, video_frames: tuple[int, int], tokens_per_frame: int,
) -> list[Sample]:
    text = _lognormal(rng, n, text_median, 0.8, 16, 16 * text_median)
    has_images = rng.random(n) < image_prob
    n_images = rng.integers(1, max_images + 1, n)
    has_video = rng.random(n) < video_prob
    frames = rng.integers(video_frames[0], video_frames[1] + 1, n)
    log_lo, log_hi = np.log(image_tokens[0]), np.log(image_tokens[1])
    samples = []
    for i in range(n):
        images: list[int] = []
        if has_images[i]:
            images += [int(np.rint(np.exp(x))) for x in rng.uniform(log_lo, log_hi, n_images[i])]
        if has_video[i]:
            images += [tokens_per_frame] * int(frames[i])  # a video is encoded frame by frame
        samples.append(Sample(i, int(text[i]) + sum(images), tuple(images)))
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
            "multimodal",
            "text (median 384) + 1-4 images of 256-16K tokens (45%) + a video of 8-256 frames x 196 tokens (15%)",
            dict(text_median=384, image_prob=0.45, max_images=4, image_tokens=(256, 16384), video_prob=0.15,
                 video_frames=(8, 256), tokens_per_frame=196),
            _draw_multimodal,
        ),
    )
}


def get_distribution(name: str) -> Distribution:
    """The distribution called `name`, or a clear error listing the names."""
    if name not in DISTRIBUTIONS:
        raise DhpError(f"unknown distribution {name!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[name]
