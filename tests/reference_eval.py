"""An independent, loop-by-loop evaluation of BENCHMARK.md section 2, used as the oracle in tests.

Deliberately written from the benchmark text with plain Python floats and no code shared with
`megatron_dhp.cost`, so that a bug there cannot hide in both. Beyond the benchmark it knows the cost
config's three optional terms (absent keys are 0, as in the reference files): a per-sample overhead s on
every rank of the sample's group, an extra per-microbatch overhead lambda on groups of more than one rank,
and a per-step overhead sigma that every rank pays before its first group (and the lower bound with it).
"""

from __future__ import annotations

import json
import math


def sample_time(cfg: dict, tokens: int, images: list[int], d: int, intra: bool) -> float:
    compute = (cfg["attn_s_per_token2"] * tokens * tokens + cfg["linear_s_per_token"] * tokens) / d
    compute += sum(cfg["enc_attn_s_per_token2"] * p * p + cfg["enc_linear_s_per_token"] * p for p in images) / d
    if d == 1:
        comm = 0.0
    else:
        bw = cfg["intra_node_bytes_per_s"] if intra else cfg["inter_node_bytes_per_s"]
        comm = cfg["comm_bytes_per_token"] * tokens * (d - 1) / d / bw
    t = max(compute, comm) if cfg["overlap_comm"] else compute + comm
    return t + cfg.get("sample_overhead_s", 0.0)


def microbatch_overhead(cfg: dict, d: int) -> float:
    return cfg["microbatch_overhead_s"] + (cfg.get("cp_microbatch_overhead_s", 0.0) if d > 1 else 0.0)


def step_time(cfg: dict, plan: dict) -> float:
    """Replay a plan JSON dict phase by phase."""
    samples = {s["id"]: s for s in plan["samples"]}
    gpn = plan["gpus_per_node"]
    finish = [cfg.get("step_overhead_s", 0.0)] * plan["world_size"]
    groups = sorted(plan["groups"], key=lambda g: g.get("phase", 0))
    current_phase = None
    for g in groups:
        if plan.get("phase_barrier") and g.get("phase", 0) != current_phase:
            if current_phase is not None:
                finish = [max(finish)] * len(finish)
            current_phase = g.get("phase", 0)
        ranks = g["ranks"]
        d = len(ranks)
        intra = len({r // gpn for r in ranks}) == 1
        total = 0.0
        for mb in g["microbatches"]:
            total += microbatch_overhead(cfg, d)
            for sid in mb:
                s = samples[sid]
                total += sample_time(cfg, s["tokens"], s.get("images", []), d, intra)
        start = max(finish[r] for r in ranks)
        for r in ranks:
            finish[r] = start + total
    return max(finish)


def lower_bound(cfg: dict, samples: list[dict]) -> float:
    """BENCHMARK.md's bound with the base m only (lambda only adds time), plus sigma."""
    n, gpn, cap, m = cfg["world_size"], cfg["gpus_per_node"], cfg["max_tokens_per_rank"], cfg["microbatch_overhead_s"]
    area, longest = 0.0, 0.0
    for s in samples:
        feasible = [d for d in range(1, n + 1) if math.ceil(s["tokens"] / d) <= cap]
        times = {d: sample_time(cfg, s["tokens"], s.get("images", []), d, d <= gpn) for d in feasible}
        area += min(d * t for d, t in times.items())
        longest = max(longest, m + min(times.values()))
    area = (area + m * sum(s["tokens"] for s in samples) / cap) / n
    return cfg.get("step_overhead_s", 0.0) + max(area, longest)


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)
