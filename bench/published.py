"""Published results re-simulated: each paper's setting under our cost model, its system's plan (our peer
implementation of it) and dhp's, against the baseline the paper measured against.

Each `Setting` states the paper's model, GPUs, context and length distribution and what of it our model
cannot take (docs/planners.md#published-results-re-simulated holds the table and the gaps explained):

- FlexSP (ASPLOS'25, Fig. "main result"): GPT-6.7B on 64 A100s, 8 per node, Wikipedia lengths at a 192K and
  a 384K context, 512 sequences a step; FlexSP's own fitted coefficients (alpha1, alpha2 = our a, b; beta =
  our m), its measured bandwidths (all-to-all ~100 GB/s in a node, ~6 GB/s across) and its ~6K-token budget.
  Their baseline: the static degree that holds the context (SP 32 at 192K, 64 at 384K); their system:
  `flexsp-milp`.
- DHP (the authors' development repository, synthetic burst): InternVL3-8B's LLM (Qwen2.5-7B: 28 layers, 3584
  hidden, 4 KV heads) on 64 Ascend 910B, 16 per node, 8192 tokens per NPU, 100 Gb/s between nodes; 128
  samples a microbatch; baseline static CP 16 x DP 4 with FFD packing; their system: `fcp-ref`.
- Megatron-LM `examples/dynamic_context_parallel` (dev branch): a 12-layer, 2048-hidden GPT at TP 1, CP 4,
  4 GPUs per node on 4 to 64 GPUs, lognormal lengths 128-8192, 2048 tokens per rank, 8 microbatches per DP
  rank; baseline `dp_balanced` (static CP 4); their system: dynamic CP (`megatron-hcp`, the released form
  of the same scheduler).

    python bench/published.py [--batches 5] [--time-limit 5] [--settings flexsp-wiki-192k,...] [--json out.json]

Columns: the published ratio; the baseline's and their plan's mean simulated step (priced as they
communicate); their plan, dhp and dhp at its best TP against the baseline, their plan and static-best (the
(TP, CP) layout a Megatron user tunes, ring); each a mean over batches of per-batch ratios.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from tuning import tune_dhp  # bench/tuning.py (this folder is the script's sys.path[0])

from megatron_dhp.cost import CostConfig, CostModel, build_cost_model
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.solver import Planner, PlannerContext, build_planner
from megatron_dhp.solver.dhp import DhpPlanner
from megatron_dhp.solver.static import StaticPlanner
from megatron_dhp.solver.static_best import steps, tune_static
from megatron_dhp.workload import LengthSource
from megatron_dhp.workload.batches import truncate_sample
from megatron_dhp.workload.sample import Batch

ULYSSES = dict(cp_comm="all-to-all", comm_bytes_per_token=4 * 2 * 4096 * 2 * 32, overlap_comm=False)
"""DeepSpeed-Ulysses as FlexSP runs and prices it: 4 all-to-alls each way per layer of a token's bf16 hidden
state, on the critical path (FlexSP's model adds them to compute)."""
FLEXSP = dict(max_tokens_per_rank=6144, microbatch_overhead_s=0.6294, intra_node_bytes_per_s=100e9,
              inter_node_bytes_per_s=6e9, attention_heads=64, tp_comm_bytes_per_token=8 * 4096 * 2 * 32)
"""GPT-6.7B as FlexSP fits and runs it: beta, its 28 GB budget (~6K tokens a GPU), its all-to-all bandwidths
(B(2..8) ~ 96-120 GB/s, B(32) = 5.94 GB/s), 64 heads; a and b are the preset's (FlexSP's alpha1, alpha2)."""
QWEN7B = dict(world_size=64, gpus_per_node=16, attn_s_per_token2=5.128e-9 * (28 * 3584) / (32 * 4096),
              linear_s_per_token=1.84e-4 * 7.6 / 6.7, comm_bytes_per_token=1.5e6 * (28 * 512) / (32 * 4096),
              intra_node_bytes_per_s=56e9, inter_node_bytes_per_s=12.5e9, attention_heads=28,
              tp_comm_bytes_per_token=8 * 3584 * 2 * 28)
"""InternVL3-8B's LLM on 910Bs: GPT-7B's coefficients scaled by layers x hidden (attention), parameters
(linear) and layers x KV width (the ring's K/V bytes, 4 KV heads of 128); HCCS ~56 GB/s, 100 Gb/s IB."""


def dcp_config(n: int) -> dict:
    """The Megatron DCP example's GPT (12 layers, 2048 hidden, 16 heads, 131,072-token vocabulary) on n GPUs,
    4 per node: GPT-7B's coefficients scaled by layers x hidden and by parameters (0.87B with the output
    layer), 2048 tokens per rank."""
    return dict(world_size=n, gpus_per_node=4, max_tokens_per_rank=2048,
                attn_s_per_token2=5.128e-9 * (12 * 2048) / (32 * 4096), linear_s_per_token=1.84e-4 * 0.87 / 6.7,
                comm_bytes_per_token=1.5e6 * (12 * 2048) / (32 * 4096), microbatch_overhead_s=0.005,
                attention_heads=16, tp_comm_bytes_per_token=8 * 2048 * 2 * 12)


@dataclass
class DpBalanced(Planner):
    """Megatron-LM's `--sequence-packing-scheduler dp_balanced` (megatron/core/datasets/data_schedule.py on
    dev), as the DCP example's baseline runs: samples in arrival order, next-fit into packs of CP x M tokens;
    the pack count evened to a multiple of DP by splitting samples off the last packs into packs of their own;
    microbatch i gives DP replica r pack i x DP + r. Unlike `static` it does not sort or balance by time."""

    cp: int = 4
    name: str = "dp-balanced"

    def solve(self, batch: Batch, model: CostModel) -> list[PlanGroup]:
        """One group per DP replica of `cp` contiguous ranks, its packs in order."""
        cap, dp = self.cp * model.domain.max_tokens_per_rank, model.domain.world_size // self.cp
        packs: list[list[int]] = [[]]
        for s in batch.samples:
            if packs[-1] and sum(batch.samples[i].tokens for i in packs[-1]) + s.tokens > cap:
                packs.append([])
            packs[-1].append(s.id)
        last = len(packs) - 1
        while len(packs) % dp:  # a sample off the last pack that holds more than one, into a pack of its own
            while len(packs[last]) < 2:
                last -= 1
            packs.append([packs[last].pop()])
        return [PlanGroup(ranks=tuple(range(r * self.cp, (r + 1) * self.cp)),
                          microbatches=tuple(tuple(packs[i]) for i in range(r, len(packs), dp)))
                for r in range(dp)]


@dataclass(frozen=True)
class Setting:
    """One published comparison: the paper's measured ratio of its system over its baseline, and the setting
    we re-simulate it in."""

    name: str
    source: str
    measured: float
    """Their system's speed-up over the baseline, as published."""
    dist: str
    global_batch: int
    baseline_cp: int
    """The static CP size of their baseline (fixed for the run)."""
    system: str
    """Our peer planner of their system."""
    config: dict = field(default_factory=dict)
    context: int | None = None
    """Samples are cut to this many tokens (the paper's maximum context), and static layouts hold it."""
    their_comm: dict = field(default_factory=dict)
    """How the paper's systems (baseline and theirs) communicate, where not as ours: ring context parallelism."""


SETTINGS = {s.name: s for s in (
    Setting("flexsp-wiki-192k", "FlexSP 6.7B, Wikipedia, 192K: vs Megatron-LM 1.98x, vs DeepSpeed 1.72x", 1.72,
            "wikipedia", 512, 32, "flexsp-milp", FLEXSP, 196608, ULYSSES),
    Setting("flexsp-wiki-384k", "FlexSP 6.7B, Wikipedia, 384K: vs Megatron-LM 1.77x, vs DeepSpeed 1.46x", 1.46,
            "wikipedia", 512, 64, "flexsp-milp", FLEXSP, 393216, ULYSSES),
    Setting("dhp-burst", "DHP dev repo, InternVL3-8B ring, burst, static CP 16 x DP 4: 1.84x", 1.84,
            "burst", 128, 16, "fcp-ref", QWEN7B),
    *(Setting(f"megatron-dcp-{n}", f"Megatron dynamic CP example, {n} GPUs: {x:.3f}x over dp_balanced", x,
              "dcp-lognormal", 8 * n // 4, 4, "megatron-hcp", dcp_config(n))
      for n, x in ((4, 1.285), (8, 1.412), (16, 1.212), (32, 1.375), (64, 1.495))),
)}


def batches(setting: Setting, capacity: int, count: int) -> list[Batch]:
    """The setting's batches (seed 0), cut to its context."""
    source = LengthSource.from_args(dist=setting.dist)
    out = [source.draw(global_batch=setting.global_batch, seed=0, index=k, capacity=capacity) for k in range(count)]
    if setting.context is None:
        return out
    return [Batch(tuple(truncate_sample(s, setting.context) for s in b.samples), seed=b.seed) for b in out]


def measure(setting: Setting, count: int, time_limit_s: float) -> dict:
    """Mean simulated steps of the baseline and their system (priced as they communicate), dhp, and the
    tuned pair (static-best, dhp at its best TP; ring, as Megatron and dhp run), over `count` batches."""
    config = replace(CostConfig.load("gpt7b-64"), **setting.config)
    ours = build_cost_model(config)
    theirs = build_cost_model(replace(config, **setting.their_comm))
    drawn = batches(setting, ours.domain.capacity, count)
    baseline = (DpBalanced(setting.baseline_cp) if setting.system == "megatron-hcp" else
                StaticPlanner(dataset_max_tokens=setting.baseline_cp * ours.domain.max_tokens_per_rank))
    system = build_planner(setting.system, PlannerContext(time_limit_s=time_limit_s))
    best_static, best_dhp = tune_static(config, drawn, setting.context)[0], tune_dhp(config, drawn)[0]
    return {"baseline": steps(theirs, drawn, baseline), "system": steps(theirs, drawn, system),
            "dhp": steps(ours, drawn, DhpPlanner()), "static-best": best_static.steps,
            "dhp-best-tp": best_dhp.steps, "static-best layout": f"TP {best_static.tp} CP {best_static.cp}",
            "dhp TP": best_dhp.tp}


def ratio(num: tuple[float, ...], den: tuple[float, ...]) -> float:
    """Mean over batches of num / den (inf where the numerator's planner cannot plan a batch)."""
    return float(np.mean(np.asarray(num) / np.asarray(den)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=5, help="batches per setting (default 5)")
    parser.add_argument("--time-limit", type=float, default=5.0, help="seconds per flexsp-milp MILP (default 5)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated: {', '.join(SETTINGS)}")
    parser.add_argument("--json", help="write every measured step here")
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    console = Console(width=200)
    results = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("re-simulating", total=len(names))
        for name in names:
            results[name] = measure(SETTINGS[name], args.batches, args.time_limit)
            progress.advance(task)
    table = Table(title=f"published results re-simulated ({args.batches} batches each; mean of per-batch ratios)")
    for col in ("setting", "published", "measured", "baseline s", "their plan s", "their plan / baseline",
                "dhp / baseline", "dhp / their plan", "static-best", "static-best / their plan",
                "dhp best TP / static-best"):
        table.add_column(col, justify="left" if col in ("setting", "published", "static-best") else "right")
    for name in names:
        s, r = SETTINGS[name], results[name]
        table.add_row(name, s.source, f"{s.measured:.2f}x", f"{np.mean(r['baseline']):.3f}", f"{np.mean(r['system']):.3f}",
                      f"{ratio(r['baseline'], r['system']):.2f}x",
                      f"{ratio(r['baseline'], r['dhp']):.2f}x", f"{ratio(r['system'], r['dhp']):.3f}x",
                      r["static-best layout"], f"{ratio(r['static-best'], r['system']):.2f}x",
                      f"{ratio(r['static-best'], r['dhp-best-tp']):.2f}x (TP {r['dhp TP']})")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
