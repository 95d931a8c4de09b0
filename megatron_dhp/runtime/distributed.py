"""Join a job: the process group (gloo, or NCCL bound to this rank's GPU) and megatron's parallel state.

Every entry point that starts ranks itself (`megatron-dhp train`, `demo`, `profile`, `selftest`) joins here;
under Megatron-LM, Megatron's own `initialize_megatron` does this instead.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dhp.runtime.group_pool import SHARE_RESOURCES


def init_distributed(
    *, backend: str = "gloo", tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1,
    virtual_pipeline: int = 1, seed: int = 0, timeout: timedelta = timedelta(seconds=120)
) -> None:
    """Join the job described by the torchrun environment and set up megatron's parallel state (CP 1;
    megatron-core carves the expert-parallel groups from the data-parallel ranks).

    On a CPU-only machine the caller switches on `launch.cpu_shim` first; this leaves megatron-core as is.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    bound = {}
    if backend == "nccl":  # new groups split from the default one and share its buffers (`group_pool.nccl_sharing`)
        gpu_environment()
        bound["device_id"] = local_device()
        torch.cuda.set_device(bound["device_id"])
    dist.init_process_group(backend=backend, timeout=timeout, **bound, **attempt_store(timeout))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline if virtual_pipeline > 1 else None,
        expert_model_parallel_size=expert_parallel,
        distributed_timeout_minutes=timeout.total_seconds() / 60,  # timedelta(minutes=...): a fraction is exact
    )
    model_parallel_cuda_manual_seed(seed)


GPU_ENVIRONMENT: dict[str, str] = {
    # NCCL reads it at its first split: groups split from the default communicator share its buffers
    SHARE_RESOURCES: "1",
    # every step has new token counts per microbatch: segments that grow keep the allocator from fragmenting
    # (read when CUDA's allocator starts, so before the first CUDA allocation)
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    # NVLink SHARP buffers come with every communicator of 3+ ranks in a node, for each of the group family's
    "NCCL_NVLS_ENABLE": "0",
    # TransformerEngine's p2p CP batches each ring step's send and receive on the group's communicator
    # instead of torch giving every pair of ranks a communicator of its own
    "NVTE_BATCH_MHA_P2P_COMM": "1",
}
"""What a GPU job of megatron-dhp runs with unless the user set it (scripts/pretrain_gpt_dhp.sh exports the same)."""


def gpu_environment() -> dict[str, str]:
    """Set `GPU_ENVIRONMENT`'s variables the user left unset, before NCCL, CUDA's allocator or TE read them;
    returns what it set. Called by `init_distributed` and, under Megatron-LM, when the `--dhp` flags are
    validated (before Megatron-LM initialises torch.distributed)."""
    unset = {name: value for name, value in GPU_ENVIRONMENT.items() if name not in os.environ}
    os.environ.update(unset)
    return unset


def local_device() -> torch.device:
    """This rank's GPU: torchrun's LOCAL_RANK."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def bind_default_group(device: torch.device, world: dist.ProcessGroup | None = None) -> bool:
    """Bind an NCCL default group to `device`, as `init_process_group(device_id=...)` does, where the launcher
    did not (Megatron-LM's `initialize_megatron`); returns whether it bound. Collective over the world.

    torch then creates every new NCCL group by splitting the default communicator (`ncclCommSplit`, sharing
    its buffers under NCCL_COMM_SPLIT_SHARE_RESOURCES=1) and connects it inside `new_group`, so the group
    family exists after set-up instead of being connected lazily inside the first steps, which NCCL warns
    can deadlock while other kernels run. The default communicator is connected first (a no-op when a
    collective already did), since non-members of a new group join its split there. Every group created
    afterwards is world-collective (torch's rule for splits): the group pool's are. `world`: the default group.
    """
    world = dist.group.WORLD if world is None else world
    if world.name() != "nccl" or world.bound_device_id is not None:
        return False
    world.bound_device_id = device
    world._get_backend(device).eager_connect_single_device(device)
    return True


def attempt_store(timeout: timedelta) -> dict:
    """Under a torchrun restart (`--max-restarts`), the rendezvous store of this attempt: torchrun's store
    with keys of their own (the `store`, `rank` and `world_size` of `init_process_group`); {} otherwise.

    torchrun keeps its store across restarts, and a restarted rank read the previous attempt's gloo
    addresses there and failed with "Connection refused" (torch 2.x, static and c10d rendezvous alike).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it, else rank 0 does
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=timeout, multi_tenant=not agent)
    return {"store": dist.PrefixStore(f"megatron-dhp/attempt-{attempt}", store), "rank": rank, "world_size": world}
