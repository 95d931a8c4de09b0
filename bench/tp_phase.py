"""Does re-forming TP per phase pay? dhp with each group free to run each sample at its own TP, against dhp
at the best fixed TP, in simulation (the design card's "re-form TP"; HotSPa-style hot switching).

`PerGroupTP` prices a group of d GPUs (positions are GPUs) running a sample at the tensor-parallel degree t
that is fastest for it, among the powers of two dividing d, the node and the heads: the sample's time as a
CP group of d / t positions of t GPUs (`cost.tensor_parallel`), plus `reshard_s[t]` for t > 1, the group's
weights all-gathered over t GPUs of a node at the phase boundary. Two prices bracket the gain: free (an
upper bound: switching hidden entirely) and one all-gather of the bf16 weights per sample run at t > 1 (a
lower bound: real switching happens once per phase, not per sample). Memory is not budgeted (a position of t
GPUs holds t x M tokens, the same per GPU at every t), so TP changes time only.

    python bench/tp_phase.py [--batches 3] [--tp-efficiency 0.9] [--domains 64,256] [--workloads ...]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from tuning import tune_dhp  # bench/tuning.py (this folder is the script's sys.path[0])

from megatron_dhp.cost import CostConfig, simulate
from megatron_dhp.cost.reference import ReferenceCostModel
from megatron_dhp.cost.tensor_parallel import per_position, tp_speedup
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.solver import run_planner
from megatron_dhp.solver.dhp import DhpPlanner
from megatron_dhp.solver.static_best import tp_degrees
from megatron_dhp.workload import LengthSource

WORKLOADS = ("wlbllm", "lognormal-pareto", "bimodal", "giant", "multimodal")
GPT7B = {"attention_heads": 32, "tp_comm_bytes_per_token": 8 * 4096 * 2 * 32}
WEIGHT_BYTES = 6.7e9 * 2
"""GPT-7B's bf16 weights: what a switch to TP t all-gathers, (t - 1) / t of it over each GPU's link."""


class PerGroupTP(ReferenceCostModel):
    """The reference model of GPUs where every sample runs at the TP (dividing its group) fastest for it."""

    def __init__(self, config: CostConfig, reshard: bool) -> None:
        super().__init__(config)
        self.positions = {t: ReferenceCostModel(per_position(replace(config, tensor_parallel=t)))
                          for t in tp_degrees(config) if t > 1}
        self.reshard_s = {t: WEIGHT_BYTES * (t - 1) / t / config.intra_node_bytes_per_s if reshard else 0.0
                          for t in self.positions}

    def tp_times(self, tokens, work, degree, intra, speed=1.0) -> dict[int, np.ndarray]:
        """Each sample's time at every TP t on d / t positions of t GPUs (plus the switch at t > 1; inf where
        t does not divide d)."""
        out = {1: super().sample_time(tokens, work, degree, intra, speed)}
        c, tokens, d = self.config, np.asarray(tokens, dtype=np.float64), np.asarray(degree)
        rest = np.asarray(work, dtype=np.float64) - c.linear_s_per_token * tokens  # attention and encoder
        for t, model in self.positions.items():
            work_t = rest / tp_speedup(t, c.tp_efficiency) + model.config.linear_s_per_token * tokens
            fits = d % t == 0
            time_t = model.sample_time(tokens, work_t, np.where(fits, d // t, 1), intra, speed) + self.reshard_s[t]
            out[t] = np.where(fits, time_t, np.inf)
        return out

    def sample_time(self, tokens, work, degree, intra, speed=1.0):
        """The fastest of `tp_times`."""
        return np.minimum.reduce(list(self.tp_times(tokens, work, degree, intra, speed).values()))

    def degree_table(self, tokens, work, lo, hi: int, speed=1.0) -> tuple[np.ndarray, np.ndarray]:
        """Every sample's time on every degree 1..hi at its best placement (inf below its `lo`), and the degrees."""
        d = np.arange(1, hi + 1)
        table = self.sample_time(np.asarray(tokens, dtype=np.float64)[:, None], np.asarray(work)[:, None],
                                 d[None, :], self.best_placement_intra(d)[None, :], speed)
        return np.where(d[None, :] < np.asarray(lo).reshape(-1, 1), np.inf, table), d

    def best_time(self, tokens, work, *, lo, hi, speed=1.0):
        """Every degree in [lo, hi] tried: the TP choice breaks the closed form's candidates."""
        table, d = self.degree_table(tokens, work, lo, hi, speed)
        k = table.argmin(axis=1)
        return table[np.arange(len(k)), k], d[k]

    def lower_bound_arrays(self, tokens, work, footprint: Footprint) -> float:
        """The reference bound with each sample's cheapest area searched over every degree (d t(L, d) falls
        where a wider group allows a larger TP)."""
        n, m = self.domain.world_size, self.config.microbatch_overhead_s
        table, d = self.degree_table(tokens, work, footprint.min_degree(), n)
        area = float((table * d[None, :]).min(axis=1).sum())
        return max((area + m * float(footprint.shared.sum()) / footprint.cap) / n, m + float(table.min(axis=1).max()))

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=3, help="batches per workload (default 3)")
    parser.add_argument("--tp-efficiency", type=float, default=0.9, help="share of the ideal speed-up kept per doubling of TP")
    parser.add_argument("--domains", default="64,256", help="GPU counts, 8 per node (default 64,256)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    console = Console(width=160)
    cases = [(int(n), w) for n in args.domains.split(",") for w in args.workloads.split(",")]
    table = Table(title=f"per-group TP against dhp at its best fixed TP (GPT-7B, eta {args.tp_efficiency}, "
                        f"{args.batches} batches of 512; mean step s)")
    for col in ("N", "workload", "dhp best fixed TP", "per-group TP, free switch", "gain", "per-group TP, priced",
                "gain", "TP mix (free)"):
        table.add_column(col, justify="right")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(cases))
        for n, workload in cases:
            config = replace(CostConfig.load("gpt7b-64"), world_size=n, tp_efficiency=args.tp_efficiency, **GPT7B)
            source = LengthSource.from_args(dist=workload)
            batches = [source.draw(global_batch=512, seed=0, index=k, capacity=n * config.max_tokens_per_rank)
                       for k in range(args.batches)]
            fixed = tune_dhp(config, batches)[0]
            cells = [f"{fixed.step_s:.3f} (TP {fixed.tp})"]
            mix = ""
            for reshard in (False, True):
                model = PerGroupTP(config, reshard)
                plans = [run_planner(DhpPlanner(), b, model) for b in batches]
                step = float(np.mean([simulate(p, model).step_time_s for p in plans]))
                cells += [f"{step:.3f}", f"{fixed.step_s / step:.3f}x"]
                if not reshard:
                    mix = tp_mix(model, plans)
            table.add_row(str(n), workload, *cells, mix)
            progress.advance(task)
    console.print(table)


def tp_mix(model: PerGroupTP, plans) -> str:
    """The share of samples each TP runs (the fastest t for each sample in its planned group)."""
    counts: dict[int, int] = {}
    for plan in plans:
        lengths = {s.id: s for s in plan.samples}
        for g in plan.groups:
            samples = [lengths[i] for mb in g.microbatches for i in mb]
            tokens = np.array([s.tokens for s in samples], dtype=np.float64)
            options = model.tp_times(tokens, model.sample_work(samples), g.size, model.is_intra(g.ranks))
            ts = list(options)
            choice = np.argmin(np.stack([options[t] for t in ts]), axis=0)
            for k in choice:
                counts[ts[k]] = counts.get(ts[k], 0) + 1
    total = sum(counts.values())
    return " ".join(f"TP{t} {100 * v / total:.0f}%" for t, v in sorted(counts.items()))


if __name__ == "__main__":
    main()
