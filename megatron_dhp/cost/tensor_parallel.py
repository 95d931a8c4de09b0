"""Tensor parallelism in the cost model: a domain position that is a tensor-parallel group of t GPUs of
one node, priced from one GPU's coefficients.

With sequence parallelism a group of t GPUs holds t times one GPU's tokens (every activation is split t
ways), computes the linear and attention work t x e^log2(t) times as fast (e = `tp_efficiency` per
doubling), moves each token's activations through an all-gather and a reduce-scatter around attention and
around the MLP (intra-node links), and exchanges a context-parallel group's keys and values over its t
GPUs' links at once (each holds 1 / t of the heads). The position's config is the one-GPU config with those
coefficients on N / t positions, g / t per node; at t = 1 it is the config itself, so every plan and number
stays as it was. docs/cost-model.md#tensor-parallelism states each formula.
"""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.errors import DhpError


def tp_speedup(t: int, efficiency: float) -> float:
    """How much faster a group of t GPUs computes than one: t x efficiency^log2(t)."""
    return t * efficiency ** math.log2(t)


def tp_comm_s_per_token(config: CostConfig, t: int) -> float:
    """Seconds of one token's tensor-parallel all-gathers and reduce-scatters on a group of t GPUs (rings:
    each GPU moves (t - 1) / t of the bytes over its intra-node link)."""
    return config.tp_comm_bytes_per_token * (t - 1) / t / config.intra_node_bytes_per_s


def token_cap(config: CostConfig, t: int) -> int:
    """M_t, the tokens a position of t GPUs holds per microbatch: t x max_tokens_per_rank, or with a stated
    memory budget what the budget leaves once each GPU holds 1 / t of the model's states and 1 / N of the
    sharded ones, over 1 / t of a token's activations: floor((budget - states / t - sharded / N) x t /
    activations per token)."""
    if not config.memory_budget_bytes:
        return config.max_tokens_per_rank * t
    states = config.model_state_bytes / t + config.sharded_state_bytes / config.world_size  # per GPU
    cap = math.floor((config.memory_budget_bytes - states) * t / config.activation_bytes_per_token)
    if cap < 1:
        raise DhpError(f"at tensor_parallel = {t} the model's states ({states:.3g} bytes per GPU) "
                       f"leave no room for a token's activations in memory_budget_bytes = {config.memory_budget_bytes:.3g}; "
                       "raise tensor_parallel or the budget")
    return cap


def per_position(config: CostConfig) -> CostConfig:
    """The config of one domain position at `config.tensor_parallel` = t (itself at t = 1 without a memory
    budget; with one, its max_tokens_per_rank derived)."""
    t = config.tensor_parallel
    if t == 1:
        return replace(config, max_tokens_per_rank=token_cap(config, 1)) if config.memory_budget_bytes else config
    if config.moe_expert_s_per_token or config.expert_parallel_size > 1:
        raise DhpError(f"cost key 'tensor_parallel' = {t} with MoE terms is not priced (expert and tensor "
                       "parallelism share the GPUs of a node); price an MoE model at tensor_parallel 1")
    if config.rank_speeds:
        raise DhpError(f"cost key 'rank_speeds' with tensor_parallel = {t}: speeds are per domain position; "
                       "state them on the positions' config (tensor_parallel 1) instead")
    speedup = tp_speedup(t, config.tp_efficiency)
    linear, comm = config.linear_s_per_token / speedup, tp_comm_s_per_token(config, t)
    return replace(
        config,
        world_size=config.world_size // t,
        gpus_per_node=config.gpus_per_node // t,
        max_tokens_per_rank=token_cap(config, t),
        attn_s_per_token2=config.attn_s_per_token2 / speedup,
        linear_s_per_token=max(linear, comm) if config.overlap_comm else linear + comm,
        enc_attn_s_per_token2=config.enc_attn_s_per_token2 / speedup,
        enc_linear_s_per_token=config.enc_linear_s_per_token / speedup,
        comm_bytes_per_token=config.comm_bytes_per_token / t,
        fsdp_gather_bytes=config.fsdp_gather_bytes / t,
        tensor_parallel=1,
        description=f"{config.description} (a position: TP {t} of these GPUs)",
    )


def fit_tensor_parallel(one_gpu: CostConfig, position: CostConfig, t: int) -> CostConfig:
    """`one_gpu` with the tensor-parallel terms that make its position at t match `position`, both profiled
    on the same device and model (`megatron-dhp profile` at TP 1, then at TP t with `--tp-from`): the speed-up
    from the attention coefficients, s_t = a_1 / a_t, gives the efficiency (s_t / t)^(1 / log2 t); what the
    linear coefficient has beyond b_1 / s_t is the TP collectives' seconds per token (the profiles are fitted
    without overlap), written as bytes at one_gpu's intra-node bandwidth. A speed-up above t (caches) keeps
    efficiency 1."""
    if t < 2:
        raise DhpError(f"fitting tensor-parallel terms needs a position profiled at TP >= 2, not {t}")
    if one_gpu.tensor_parallel != 1 or position.tensor_parallel != 1:
        raise DhpError("fit the tensor-parallel terms from two profiled configs (tensor_parallel 1 each: one of a "
                       "GPU, one of a position of t GPUs)")
    if not (one_gpu.attn_s_per_token2 > 0 and position.attn_s_per_token2 > 0):
        raise DhpError("both profiles need an attention coefficient a > 0 to measure the speed-up; profile longer "
                       "--lengths")
    speedup = one_gpu.attn_s_per_token2 / position.attn_s_per_token2
    efficiency = min(1.0, (speedup / t) ** (1.0 / math.log2(t)))
    comm_s = max(0.0, position.linear_s_per_token - one_gpu.linear_s_per_token / tp_speedup(t, efficiency))
    return replace(one_gpu, tp_efficiency=efficiency,
                   tp_comm_bytes_per_token=comm_s * one_gpu.intra_node_bytes_per_s * t / (t - 1),
                   description=f"{one_gpu.description}; TP terms fitted at TP {t} ({position.description})")
