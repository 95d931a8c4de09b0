"""An independent, loop-by-loop evaluation of the reference cost model (docs/cost-model.md), used as the oracle in tests.

Deliberately written from the formulas of that page with plain Python floats and no code shared with
`megatron_dhp.cost`, so that a bug there cannot hide in both. Beyond the benchmark it knows the cost
config's three optional terms (absent keys are 0, as in the reference files): a per-sample overhead s on
every rank of the sample's group, an extra per-microbatch overhead lambda on groups of more than one rank,
and a per-step overhead sigma that every rank pays before its first group (and the lower bound with it).
It also knows the mixture-of-experts terms (docs/cost-model.md): expert seconds per token and the
all-to-all bytes per token on the expert-parallel groups, both added to compute.
"""

from __future__ import annotations

import json
import math


def sample_time(cfg: dict, tokens: int, images: list[dict], d: int, intra: bool) -> float:
    compute = (cfg["attn_s_per_token2"] * tokens * tokens + cfg["linear_s_per_token"] * tokens) / d
    compute += sum(cfg["enc_attn_s_per_token2"] * sum(b * b for b in item.get("blocks", [item["enc"]]))
                   + cfg["enc_linear_s_per_token"] * item["enc"] for item in images) / d
    compute += (cfg.get("moe_expert_s_per_token", 0.0) + cfg.get("moe_a2a_bytes_per_token", 0.0) / ep_bandwidth(cfg)) * tokens / d
    if d == 1:
        comm = 0.0
    else:
        bw = cfg["intra_node_bytes_per_s"] if intra else cfg["inter_node_bytes_per_s"]
        comm = cfg["comm_bytes_per_token"] * tokens * (d - 1) / d / bw
    t = max(compute, comm) if cfg["overlap_comm"] else compute + comm
    return t + cfg.get("sample_overhead_s", 0.0)


def ep_bandwidth(cfg: dict) -> float:
    """The intra-node bandwidth if every expert-parallel group (consecutive ranks) sits in one node."""
    ep, gpn = cfg.get("expert_parallel_size", 1), cfg["gpus_per_node"]
    one_node = all(len({r // gpn for r in range(start, start + ep)}) == 1 for start in range(0, cfg["world_size"], ep))
    return cfg["intra_node_bytes_per_s"] if one_node else cfg["inter_node_bytes_per_s"]


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
    """The reference bound with the base m only (lambda only adds time), plus sigma."""
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


def pipeline_step_time(cfg: dict, plan: dict) -> float:
    """Replay a plan JSON dict with `pipeline_stages` P > 1 as 1F1B per stage over each position's slots.

    Written from the rule's text: slots phase by phase, every phase but the last padded with idle one-token
    microbatches to the most any position runs in it; a microbatch's PP = 1 time T costs T / (3P) forward and
    2T / (3P) backward on each stage; warm-up min(P - s - 1, K), then F/B alternately, then the rest of the
    backwards; an op starts when its stage neighbour's op, its stage's previous op on every member, and sigma
    allow. Ops are relaxed to a fixed point (no topological order needed).

    Interleaved (`virtual_stages` V > 1), from megatron-core's schedule: the last phase is padded too and
    every position to the same slot count, a multiple of P; a forward index k runs slot (group of P slots,
    k // (P V)) and chunk (k % (P V)) // P, its backward the same slot and chunk V - 1 - that; warm-up
    min(2 (P - s - 1) + (V - 1) P, K V); each op costs T / (3PV) or 2T / (3PV); a chunk's forward on stage 0
    follows the previous chunk's on the last stage, a backward on the last stage the next chunk's on stage 0.
    """
    p, v = plan["pipeline_stages"], plan.get("virtual_stages", 1)
    samples = {s["id"]: s for s in plan["samples"]}
    gpn, n = plan["gpus_per_node"], plan["world_size"]
    groups = plan["groups"]
    phases = 1 + max(g.get("phase", 0) for g in groups)
    rows: list[list] = [[] for _ in range(n)]
    for q in range(phases):
        for gi, g in enumerate(groups):
            if g.get("phase", 0) == q:
                for r in g["ranks"]:
                    rows[r] += [(gi, j) for j in range(len(g["microbatches"]))]
        if q < phases - 1:
            target = max(len(row) for row in rows)  # rows were equal before the phase: offset + its widest
            for r in range(n):
                rows[r] += [("idle", r, len(rows[r]) + i) for i in range(target - len(rows[r]))]
    if v > 1:
        target = -(-max(len(row) for row in rows) // p) * p
        for r in range(n):
            rows[r] += [("idle", r, len(rows[r]) + i) for i in range(target - len(rows[r]))]

    def unit_time(unit) -> float:
        if unit[0] == "idle":
            return microbatch_overhead(cfg, 1) + sample_time(cfg, 1, [], 1, True)
        g = groups[unit[0]]
        d, intra = len(g["ranks"]), len({r // gpn for r in g["ranks"]}) == 1
        mb = g["microbatches"][unit[1]]
        return microbatch_overhead(cfg, d) + sum(
            sample_time(cfg, samples[i]["tokens"], samples[i].get("images", []), d, intra) for i in mb)

    sigma = cfg.get("step_overhead_s", 0.0)
    end: dict = {}
    orders = []
    for r in range(n):
        k = len(rows[r])
        for s in range(p):
            if v == 1:
                w = min(p - s - 1, k)
                slot_of = [(j, 0) for j in range(k)]
            else:
                w = min(2 * (p - s - 1) + (v - 1) * p, k * v)
                slot_of = [((i // (p * v)) * p + i % p, (i % (p * v)) // p) for i in range(k * v)]
            total = len(slot_of)
            order = [("F", j) for j in range(w)]
            for i in range(total - w):
                order += [("F", w + i), ("B", i)]
            order += [("B", j) for j in range(total - w, total)]
            ops = []
            for kind, i in order:
                j, c = slot_of[i]
                ops.append((kind, rows[r][j], s, c if kind == "F" else v - 1 - c))
            orders.append(ops)
    changed = True
    while changed:
        changed = False
        for order in orders:
            prev = sigma
            for kind, unit, s, c in order:
                if kind == "F":
                    dep = end.get(("F", unit, s - 1, c), sigma) if s > 0 else end.get(("F", unit, p - 1, c - 1), sigma) if c > 0 else sigma
                elif s < p - 1:
                    dep = end.get(("B", unit, s + 1, c), sigma)
                else:
                    dep = end.get(("B", unit, 0, c + 1), sigma) if c < v - 1 else end.get(("F", unit, s, c), sigma)
                key = (kind, unit, s, c)
                begin = max(prev, dep, end.get(key + ("start",), sigma))
                share = 1 / 3 if kind == "F" else 2 / 3
                finish = begin + unit_time(unit) * share / (p * v)
                if finish > end.get(key, -1.0) + 1e-15:
                    end[key] = finish
                    end[key + ("start",)] = begin
                    changed = True
                prev = end[key]
    return max(val for key, val in end.items() if len(key) == 4)

