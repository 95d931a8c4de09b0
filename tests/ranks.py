"""How every spawned CPU rank of the multi-process tests joins its job: one helper for the worker modules. Leaving
needs none: the launcher destroys a rank's process groups once its function returns (`launch.ranks`)."""

from __future__ import annotations

import warnings
from datetime import timedelta

import torch.distributed as dist

from megatron_dhp.launch.cpu_shim import apply_cpu_compat
from megatron_dhp.runtime.distributed import init_distributed


def start_cpu_rank(*, tensor_parallel: int = 1, pipeline_parallel: int = 1, virtual_pipeline: int = 1,
                   expert_parallel: int = 1, timeout_s: float = 60) -> None:
    """Quiet warnings, the CPU shim, then the process groups and megatron's parallel state (gloo)."""
    warnings.filterwarnings("ignore")
    apply_cpu_compat()
    init_distributed(tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                     virtual_pipeline=virtual_pipeline, expert_parallel=expert_parallel,
                     timeout=timedelta(seconds=timeout_s))


def start_gloo_rank(*, timeout_s: float = 60) -> None:
    """Quiet warnings and join the world over gloo, without megatron's parallel state: for workers that test
    collectives and attention on plain groups."""
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
