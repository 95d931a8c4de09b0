"""The reference cost model (docs/cost-model.md), vectorised over samples.

For a sample of length L on a group of d ranks:
    compute(L, d) = (a L^2 + b L + sum_images (e sum_blocks B^2 + f P)) / d
    comm(L, d)    = 0 if d == 1 else gamma L (d - 1) / d / bw      (ring; all-to-all: gamma L (d - 1) / d^2 / bw)
    t(L, d)       = max(compute, comm) if overlap_comm else compute + comm
where bw is the intra-node bandwidth when all the group's ranks sit on one node. A microbatch costs
m + sum t and is feasible only if sum L / d <= M. Three optional terms, 0 in the reference model and set by
`megatron-dhp profile` where a device needs them: a per-sample overhead s added to t, a per-microbatch
overhead lambda on groups of more than one rank, and a per-step overhead sigma before the first microbatch.

Mixture of experts: a MoE model adds, per token, its top-k experts' seconds x and the dispatcher's
all-to-all, alpha bytes on the static expert-parallel group (bandwidth bw_EP: intra-node when every EP group
sits in one node). A sample on d ranks routes L / d tokens from each rank, so both split over the group:
    compute(L, d) = (a L^2 + (b + x + alpha / bw_EP) L + sum_images (e P^2 + f P)) / d
The all-to-all counts as compute, outside the max with the context-parallel comm: megatron-core's alltoall
dispatcher runs between the router and the experts, on the compute stream's critical path, and is not
overlapped with expert compute by default; and it runs on the EP group, whatever the sample's CP group is, so
it does not depend on that group's placement. d t(L, d) stays non-decreasing in d, so the lower bound holds.

The encoder term above is the `split` placement; `replicate` keeps it whole in every rank's compute,
    compute(L, d) = (a L^2 + b L) / d + W_enc,
and `global` takes it out of the groups into a step-level phase before the first and after the last
microbatch (`cost.encoder`). Under both d t(L, d) is still non-decreasing in d, so the bounds hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from megatron_dhp.cost.config import CostConfig, Domain
from megatron_dhp.cost.encoder import EncoderPhase, SampleWork, fixed_work, global_phase, sample_encoder_work
from megatron_dhp.plan.memory import Footprint, MemoryRule
from megatron_dhp.plan.shares import Pace, pace, shares_for_speeds
from megatron_dhp.workload.sample import Sample

NOMINAL_PACE = Pace(1.0, 1.0)


SCREENED = 64
"""The lower bound with rank speeds takes each sample's minimum over the speed levels first for this many
samples, those of the largest upper bound (`ReferenceCostModel._longest`)."""


class ReferenceCostModel:
    """Times of samples on groups, and the step-time lower bound, for one `CostConfig` (a `CostModel`)."""

    def __init__(self, config: CostConfig) -> None:
        self.config = config
        self.domain: Domain = config.domain
        self.step_overhead_s = config.step_overhead_s
        # The EP groups (consecutive ranks) each sit in one node iff they tile the nodes or the domain is one node.
        g = self.domain.gpus_per_node
        ep_intra = g % config.expert_parallel_size == 0 or self.domain.world_size <= g
        ep_bytes_per_s = config.intra_node_bytes_per_s if ep_intra else config.inter_node_bytes_per_s
        # b + x + alpha / bw_EP: the seconds per token that split over a sample's group (exactly b when dense).
        self.per_token_s = (config.linear_s_per_token + config.moe_expert_s_per_token
                            + config.moe_a2a_bytes_per_token / ep_bytes_per_s)
        # `auto` is resolved by the planner (solver.encoder_auto); until then the model prices as split.
        self.encoder_placement = config.encoder_placement
        self._pricing = "split" if config.encoder_placement == "auto" else config.encoder_placement
        self.all_to_all = config.cp_comm == "all-to-all"
        self.uneven_shards = config.uneven_shards

    def with_placement(self, placement: str) -> ReferenceCostModel:
        """This model with the encoder run as `placement`."""
        return self if placement == self.encoder_placement else type(self)(replace(self.config, encoder_placement=placement))

    # ------------------------------------------------------------------ per-sample terms
    def sample_work(self, samples: Sequence[Sample]) -> np.ndarray:
        """Compute seconds of each sample on one rank: a L^2 + (b + x + alpha / bw_EP) L, plus the encoder's
        seconds unless the encoder runs `global`; under `replicate` a `SampleWork` whose encoder part is fixed."""
        c = self.config
        tokens = np.fromiter((s.tokens for s in samples), dtype=np.float64, count=len(samples))
        work = c.attn_s_per_token2 * tokens**2 + self.per_token_s * tokens
        if self._pricing == "global":
            return work
        encoder = sample_encoder_work(c, samples)
        return SampleWork(work + encoder, encoder) if self._pricing == "replicate" else work + encoder

    def encoder_time(self, samples: Sequence[Sample], degree: np.ndarray | int) -> np.ndarray:
        """Seconds of each sample's encoder work inside its group of `degree` ranks (0 under `global`)."""
        if self._pricing == "global":
            return np.zeros(len(samples))
        encoder = sample_encoder_work(self.config, samples)
        return encoder if self._pricing == "replicate" else encoder / degree

    def attention_time(self, samples: Sequence[Sample], degree: np.ndarray | int) -> np.ndarray:
        """a L^2 / d, plus the encoder's e sum_blocks B^2 as the placement puts it in the group (split: / d;
        replicate: whole; global: outside the groups, none): the terms `CostConfig.scaled` scales by `attention`."""
        tokens = np.fromiter((s.tokens for s in samples), dtype=np.float64, count=len(samples))
        attention = self.config.attn_s_per_token2 * tokens**2 / degree
        if self._pricing == "global":
            return attention
        encoder = sample_encoder_work(self.config, samples, linear=False)
        return attention + (encoder if self._pricing == "replicate" else encoder / degree)

    def encoder_phase(self, samples: Sequence[Sample], *, bound: bool = False) -> EncoderPhase:
        """The step-level encoder time outside the groups (`global`; zero otherwise); `bound`: a lower bound."""
        return global_phase(self.config, samples, bound=bound) if self._pricing == "global" else EncoderPhase()

    def sample_time(self, tokens: np.ndarray, work: np.ndarray, degree: np.ndarray | int, intra: np.ndarray | bool,
                    speed: np.ndarray | float = 1.0, *, slowest: np.ndarray | float | None = None,
                    comm_scale: np.ndarray | float = 1.0) -> np.ndarray:
        """t(L, d): seconds each sample takes on a group of `degree` ranks whose split compute runs at `speed`
        (broadcasts over arrays): compute divides by the speed; the per-sample overhead, and comm with
        `speed_scales_comm`, by the `slowest` member's (default `speed`: even shards); comm is `comm_scale`
        times the even split's (uneven shards, `plan.shares.Pace`)."""
        c = self.config
        d = np.asarray(degree, dtype=np.float64)
        bw = np.where(intra, c.intra_node_bytes_per_s, c.inter_node_bytes_per_s)
        fixed = fixed_work(work)
        work = np.asarray(work, dtype=np.float64)
        even = slowest is None
        slowest = speed if even else slowest
        nominal = np.isscalar(speed) and speed == 1.0 and np.isscalar(slowest) and slowest == 1.0
        if fixed is not None and not even:  # the undivided part runs whole on every rank, at the slowest's speed
            compute = (work - fixed) / d / speed + fixed / slowest
        else:
            compute = work / d if fixed is None else (work - fixed) / d + fixed
            if not nominal:
                compute = compute / speed
        comm = c.comm_bytes_per_token * np.asarray(tokens, dtype=np.float64) * (d - 1.0) / d / bw
        if self.all_to_all:  # each rank sends its own L / d tokens' share
            comm = comm / d
        if not (np.isscalar(comm_scale) and comm_scale == 1.0):
            comm = comm * comm_scale
        if not nominal and c.speed_scales_comm:
            comm = comm / slowest
        t = np.maximum(compute, comm) if c.overlap_comm else compute + comm
        if not c.sample_overhead_s:
            return t
        return t + (c.sample_overhead_s if nominal else c.sample_overhead_s / slowest)

    def group_speed(self, ranks: Sequence[int]) -> float:
        """The speed a group computes at: its slowest member's."""
        return 1.0 if self.domain.nominal else float(self.domain.speeds[list(ranks)].min())

    def group_pace(self, ranks: Sequence[int], shares: Sequence[int] = ()) -> Pace:
        """How fast a group of these ranks runs with `shares` (empty: even; `plan.shares.pace`)."""
        return NOMINAL_PACE if self.domain.nominal and not len(shares) else pace(self.domain.speeds[list(ranks)], shares)

    def group_shares(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The shares a group of these ranks runs with: in proportion to their speeds where `uneven_shards`
        allows (and they differ), else even (empty)."""
        if self.domain.nominal or not self.uneven_shards:
            return ()
        return shares_for_speeds(self.domain.speeds[list(ranks)])

    def with_speeds(self, speeds: tuple[float, ...]) -> ReferenceCostModel:
        """This model with the ranks at `speeds` (empty: all at 1, the speed-blind model)."""
        return self if tuple(speeds) == self.domain.rank_speeds else type(self)(replace(self.config, rank_speeds=tuple(speeds)))

    def is_intra(self, ranks: Sequence[int]) -> bool:
        """Whether a group's ranks all sit on one node."""
        g = self.domain.gpus_per_node
        return len({r // g for r in ranks}) == 1

    def best_placement_intra(self, degree: np.ndarray | int) -> np.ndarray:
        """Whether a group of this size can sit inside one node (its best placement)."""
        return np.asarray(degree) <= self.domain.gpus_per_node

    def time_table(self, tokens: np.ndarray, work: np.ndarray, degrees: np.ndarray) -> np.ndarray:
        """(samples, degrees): t(L_i, d) of every sample on every group size, each group at its best placement."""
        degrees = np.asarray(degrees)
        return self.sample_time(np.asarray(tokens)[:, None], np.asanyarray(work)[:, None], degrees[None, :],
                                self.best_placement_intra(degrees)[None, :])

    def memory_rule(self) -> MemoryRule:
        """M, w and the placement the encoder's activations count under, and g (`plan.memory`)."""
        return MemoryRule(self.domain.max_tokens_per_rank, self.config.enc_memory_per_token, self._pricing,
                          self.config.kv_memory_per_token)

    def footprint(self, samples: Sequence[Sample]) -> Footprint:
        """Each sample's memory under `memory_rule` on this domain."""
        return self.memory_rule().footprint(samples, self.domain.world_size)

    def microbatch_overhead(self, group_size: int, speed: float = 1.0) -> float:
        """m (over the group's `speed`: it is compute), plus the optional lambda (`cp_microbatch_overhead_s`,
        collective latency, over the speed only with `speed_scales_comm`) on a group of more than one rank."""
        c = self.config
        if speed == 1.0:
            return c.microbatch_overhead_s + (c.cp_microbatch_overhead_s if group_size > 1 else 0.0)
        lam = c.cp_microbatch_overhead_s / speed if c.speed_scales_comm else c.cp_microbatch_overhead_s
        return c.microbatch_overhead_s / speed + (lam if group_size > 1 else 0.0)

    def microbatch_time(self, samples: Sequence[Sample], ranks: Sequence[int], shares: Sequence[int] = ()) -> float:
        """m (+ lambda) + sum of t over the microbatch's samples, on the given ranks with `shares` (empty: even,
        at their slowest's speed)."""
        tokens = np.fromiter((s.tokens for s in samples), dtype=np.float64, count=len(samples))
        p = self.group_pace(ranks, shares)
        t = self.sample_time(tokens, self.sample_work(samples), len(ranks), self.is_intra(ranks), p.speed,
                             slowest=p.slowest, comm_scale=p.comm_scale)
        return self.microbatch_overhead(len(ranks), p.slowest) + float(t.sum())

    def with_token_cap(self, max_tokens_per_rank: int) -> ReferenceCostModel:
        """This model with another per-rank token cap M."""
        return type(self)(replace(self.config, max_tokens_per_rank=max_tokens_per_rank))

    # ------------------------------------------------------------------ best degree
    def best_time(self, tokens: np.ndarray, work: np.ndarray, *, lo: np.ndarray | int, hi: np.ndarray | int,
                  speed: np.ndarray | float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """min over d in [lo, hi] of t(L, d) with the best placement (on ranks at `speed`), and the d that
        attains it; `lo`, `hi` and `speed` broadcast against the samples (several speed levels at once).

        Within one bandwidth regime t(d) = max((W - F)/d + F, c(d-1)/d) (F: the undivided part, 0 but under
        `replicate`) is minimised where the two terms cross, at d* = 1 + W/(c - F), and t(d) = (W - F)/d + F +
        c(d-1)/d is monotone in d; so the optimum is one of a few candidates per sample (range ends, node
        boundary, the crossing), evaluated vectorised. Under all-to-all comm, c(d-1)/d^2, both terms fall with
        d from 2 on, so the range ends and the node boundary hold it (the crossings are merely evaluated too).
        """
        tokens = np.asarray(tokens, dtype=np.float64)
        shape = np.broadcast_shapes(tokens.shape, np.shape(lo), np.shape(hi), np.shape(speed))
        fixed = fixed_work(work)
        fixed = np.zeros_like(tokens) if fixed is None else np.broadcast_to(fixed, tokens.shape)
        plain = np.asarray(work, dtype=np.float64)
        if not (np.isscalar(speed) and speed == 1.0):  # compute at `speed` is compute at 1 with the work scaled
            fixed, plain = fixed / speed, plain / speed
        c = self.config
        g = self.domain.gpus_per_node
        lo = np.broadcast_to(np.asarray(lo, dtype=np.int64), shape)
        hi = np.broadcast_to(np.asarray(hi, dtype=np.int64), shape)
        slowed = speed if c.speed_scales_comm else 1.0  # and comm too where it runs on the ranks' cores
        comm_intra = c.comm_bytes_per_token * tokens / c.intra_node_bytes_per_s / slowed
        comm_inter = c.comm_bytes_per_token * tokens / c.inter_node_bytes_per_s / slowed
        with np.errstate(divide="ignore", invalid="ignore"):
            cross_intra = 1.0 + plain / np.where(comm_intra - fixed > 0, comm_intra - fixed, np.inf)
            cross_inter = 1.0 + plain / np.where(comm_inter - fixed > 0, comm_inter - fixed, np.inf)
        cands = [lo, hi, np.full(shape, g, dtype=np.int64), np.full(shape, g + 1, dtype=np.int64)]
        for cross in (cross_intra, cross_inter):
            f = np.floor(np.minimum(cross, hi)).astype(np.int64)
            cands += [f, f + 1]
        best_t = np.full(shape, np.inf)
        best_d = lo.copy()
        for d in cands:
            d = np.clip(d, lo, hi)
            t = self.sample_time(tokens, work, d, d <= g, speed)
            better = (t < best_t) | ((t == best_t) & (d < best_d))
            best_t = np.where(better, t, best_t)
            best_d = np.where(better, d, best_d)
        return best_t, best_d

    # ------------------------------------------------------------------ lower bound
    def lower_bound(self, samples: Sequence[Sample]) -> float:
        """LB = sigma + max((sum_s min_d d t(L, d) + m sum L / M) / N, max_s (m + min_d t(L, d))), plus the
        bound on `global`'s encoder phase.

        d ranges over feasible degrees (the memory rule's minimum, `Footprint.min_degree`: ceil(L / M) without
        encoder memory, and d <= N) with the best placement. d t(L, d) is non-decreasing in d for both overlap
        modes and both comm forms (compute total is fixed, communication grows), so the first term takes the
        minimum. With encoder memory L / M is the shared footprint over the cap (a microbatch's ranks hold at
        least that share).
        """
        tokens = np.fromiter((s.tokens for s in samples), dtype=np.int64, count=len(samples))
        return (self.step_overhead_s + self.encoder_phase(samples, bound=True).total_s
                + self.lower_bound_arrays(tokens, self.sample_work(samples), self.footprint(samples)))

    def lower_bound_arrays(self, tokens: np.ndarray, work: np.ndarray, footprint: Footprint) -> float:
        """The groups' part of `lower_bound` (without sigma) from the samples' token counts, `sample_work` and
        `footprint`, for planners that compare it with their own makespans.

        With rank speeds (docs/cost-model.md) the work spreads over the sum of the speeds S: the d ranks of a
        sample's group deliver sum_r s_r t(L, d) >= its work, and at least d u_d times its communication (u_d
        the mean of the d slowest speeds, `Domain.slowest_groups`; with uneven shards too: no split lowers
        the even comm), so the first term is sum_s lo u_lo t(L, lo, u_lo) + m sum L / M, over S; and a sample on d ranks runs no faster than on the d fastest, so
        the second takes each degree at the d-th fastest speed, or with uneven shards at the mean of the d
        fastest (`Domain.speed_levels`: a larger speed, so a smaller time, for comm and m too). No time is shorter than at speed 1 over the fastest
        rank's speed (if above 1), so the speed-blind bound over that holds too; the largest counts (the
        speeds' area discounts communication on every rank as on the slowest, which the blind one does not)."""
        n, m = self.domain.world_size, self.config.microbatch_overhead_s
        lo = footprint.min_degree()
        if np.any(lo > n):
            raise ValueError("lower_bound needs every sample to fit the domain; check with fit_to_domain first")
        tokens = np.asarray(tokens, dtype=np.float64)
        overheads = m * float(footprint.shared.sum()) / footprint.cap
        if self.domain.nominal:
            area = lo * self.sample_time(tokens, work, lo, self.best_placement_intra(lo))
            best_t, _ = self.best_time(tokens, work, lo=lo, hi=n)
            return max((float(area.sum()) + overheads) / n, m + float(best_t.max()))
        speeds = self.domain.speeds
        nominal = self.with_speeds(()).lower_bound_arrays(tokens, work, footprint) / max(1.0, float(speeds.max()))
        slow = self.domain.slowest_groups()[lo - 1]
        area = lo * slow * self.sample_time(tokens, work, lo, self.best_placement_intra(lo), slow)
        return max(nominal, (float(area.sum()) + overheads) / float(speeds.sum()), self._longest(tokens, work, lo))

    def _longest(self, tokens: np.ndarray, work: np.ndarray, lo: np.ndarray) -> float:
        """max over samples of min over the speed levels (v, a, b) that reach the sample of m / v + its best
        time on a <= d <= b ranks at v: the bound's second term with rank speeds. The minimum needs every level
        (a dozen and more where speeds drift) but only where it can be the largest: any one level bounds a
        sample's minimum from above (the widest reaches every sample), so the minimum is taken for the samples
        of the largest such bounds, then for whichever others still exceed it. Each sample's value is as if all
        were taken."""
        m, levels = self.config.microbatch_overhead_s, self.domain.speed_levels(self.uneven_shards)

        v, a, b = (np.array(column)[:, None] for column in zip(*levels))

        def minimum(index: np.ndarray) -> np.ndarray:  # every level at once: (levels, samples)
            t, _ = self.best_time(tokens[index], work[index], lo=np.maximum(lo[index], a), hi=b, speed=v)
            return np.where(lo[index] <= b, m / v + t, np.inf).min(axis=0)

        widest_v, widest_a, widest_b = levels[-1]  # b = N: every sample fits it
        upper = m / widest_v + self.best_time(tokens, work, lo=np.maximum(lo, widest_a), hi=widest_b, speed=widest_v)[0]
        order = np.argsort(-upper, kind="stable")
        first = order[:SCREENED]
        longest = float(minimum(first).max())
        rest = order[SCREENED:][upper[order[SCREENED:]] > longest]
        return max(longest, float(minimum(rest).max())) if len(rest) else longest
