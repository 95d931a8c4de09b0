"""`megatron-dhp dists`: the named length distributions, their parameters and the quantiles they produce."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `dists`."""
    p = sub.add_parser("dists", help="list the length distributions with their quantiles",
                       description="Describe every named length distribution: parameters and the quantiles "
                                   "of a large seeded draw.")
    p.add_argument("--samples", type=int, default=20000, help="draw size for the quantiles (default 20000)")
    p.add_argument("--capacity", type=int, default=64 * 8192, help="domain capacity N x M (default 64 x 8192)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print one row per distribution."""
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from megatron_dhp.workload.synthetic import DISTRIBUTIONS

    table = Table(title=f"length distributions ({args.samples} draws, seed 0, capacity {args.capacity})")
    for col in ("name", "what", "p50", "p90", "p99", "max", "mean", "images/sample", "enc tokens/sample"):
        table.add_column(col, justify="left" if col in ("name", "what") else "right")
    for d in DISTRIBUTIONS.values():
        samples = d.draw(np.random.default_rng(0), args.samples, capacity=args.capacity)
        lengths = np.array([s.tokens for s in samples])
        q = np.percentile(lengths, [50, 90, 99]).astype(int)
        images = np.mean([len(s.images) for s in samples])
        enc = np.mean([sum(item.enc for item in s.images) for s in samples])
        table.add_row(d.name, d.description, *map(str, q), str(lengths.max()), f"{lengths.mean():.0f}", f"{images:.1f}",
                      f"{enc:.0f}")
    Console(width=200).print(table)
    for d in DISTRIBUTIONS.values():
        if d.params:
            print(f"{d.name}: {', '.join(f'{k}={v}' for k, v in d.params.items())}")
    return 0
