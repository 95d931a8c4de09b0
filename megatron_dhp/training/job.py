"""Where a training job's ranks come from: spawned here (gloo, one compute thread each) or torchrun's.

Under torchrun (RANK and WORLD_SIZE set) the process is one rank and runs the function itself; otherwise
`train.nproc` local ranks are spawned with `launch.ranks`, which gives each the torchrun environment and
OMP_NUM_THREADS=1 so that wall time reflects the plan rather than core contention. A `DhpError` on a rank
comes back as a `DhpError` in the caller (one line for the CLI), not as a traceback.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from megatron_dhp.errors import DhpError, DhpRunError, DhpStopped
from megatron_dhp.training.config import TrainConfig


@dataclass(frozen=True)
class _Failure:
    """A rank's `DhpError`, carried back to the launching process."""

    message: str
    partial: Any = None
    """What the rank had done before the error (`DhpRunError.partial`), if anything."""


def under_torchrun() -> bool:
    """Whether this process is already one rank of a job (torchrun's environment is set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_on_ranks(fn: Callable[..., Any], config: TrainConfig, *args: Any, timeout_s: float = float("inf")) -> Any:
    """`fn(config, *args)` on every rank of the job; returns rank 0's result (this rank's under torchrun).

    `fn` must be a module-level function returning something picklable. `timeout_s` bounds the whole job
    when ranks are spawned (each collective is bounded by `train.timeout_s` regardless). Before any rank
    starts: injected slow ranks must be ranks of the job, and spawned ranks at most twice the cores unless
    `train.oversubscribe` (`launch.ranks.check_oversubscription`).
    """
    from megatron_dhp.closed_loop.injection import check_injected_ranks
    from megatron_dhp.launch.ranks import (
        LaunchError,
        LaunchStopped,
        check_oversubscription,
        exit_with_parent,
        launch,
    )

    run = config.train
    check_injected_ranks(config.dhp.slow_ranks, int(os.environ["WORLD_SIZE"]) if under_torchrun() else run.num_ranks)
    if under_torchrun():
        exit_with_parent()  # torchrun's agent killed outright leaves its workers running otherwise
        results = [rank_main(fn, config, *args)]
    else:
        check_oversubscription(run.num_ranks, oversubscribe=run.oversubscribe)
        # megatron-core warns about missing TransformerEngine / Apex while a spawned rank unpickles its
        # function, before any code of ours runs there; the environment is the only way to reach that.
        try:
            results = launch(rank_main, config.train.num_ranks, fn, config, *args, timeout_s=timeout_s,
                             env={"PYTHONWARNINGS": "ignore"})
        except LaunchStopped as e:
            raise DhpStopped(str(e), e.signum) from None
        except LaunchError as e:
            raise DhpError(str(e)) from None
    failures = [r for r in results if isinstance(r, _Failure)]
    if failures:
        first = failures[0]
        raise DhpError(first.message) if first.partial is None else DhpRunError(first.message, first.partial)
    return results[0]


def rank_main(fn: Callable[..., Any], config: TrainConfig, *args: Any) -> Any:
    """One rank: join the job (gloo on CPU, NCCL on GPU), run `fn`, leave the job."""
    import torch
    import torch.distributed as dist

    from megatron_dhp.launch.cpu_shim import apply_cpu_compat
    from megatron_dhp.runtime.distributed import init_distributed

    warnings.filterwarnings("ignore")  # megatron-core warns once per rank about missing TE / Apex
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        apply_cpu_compat()
    world = int(os.environ["WORLD_SIZE"])
    if config.train.pin_cores and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", 0)) % len(cores)]})
    try:
        run = config.train
        if world % run.model_parallel:
            raise DhpError(f"the job has {world} ranks, not a multiple of train.tp x train.pp = {run.tp} x {run.pp}"
                           if run.pp > 1 else f"the job has {world} ranks, not a multiple of train.tp = {run.tp}")
        init_distributed(backend=backend, tensor_parallel=run.tp, pipeline_parallel=run.pp, virtual_pipeline=run.vpp,
                         seed=run.seed,
                         timeout=timedelta(seconds=run.timeout_s))
        return fn(config, *args)
    except DhpError as e:
        return _Failure(str(e), getattr(e, "partial", None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
