"""How a GPU job's NCCL is set up: the environment, and a Megatron-LM-style default group bound to its GPU so
that the group family is split from it (resources shared) and connected at set-up. NCCL does not run here: the
default group is a stand-in recording what torch's split decision reads (`bound_device_id`) and the connection;
a gloo group shows the CPU path is left alone. gpu_check's safety section runs the same on one NCCL rank."""

from __future__ import annotations

import os

import torch

from megatron_dhp.runtime import distributed
from megatron_dhp.runtime.distributed import GPU_ENVIRONMENT, bind_default_group, gpu_environment


class _Backend:
    def __init__(self) -> None:
        self.connected: list[torch.device] = []

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.connected.append(device)


class _DefaultGroup:
    """What `bind_default_group` touches of Megatron-LM's default group (`init_process_group` without
    `device_id`): torch splits new groups from it only once `bound_device_id` is set."""

    def __init__(self, backend: str) -> None:
        self.backend, self.bound_device_id, self.nccl = backend, None, _Backend()

    def name(self) -> str:
        return self.backend

    def _get_backend(self, device: torch.device) -> _Backend:
        return self.nccl


def test_a_megatron_lm_default_group_is_bound_to_its_gpu_and_connected_once():
    world, gpu = _DefaultGroup("nccl"), torch.device("cuda", 3)
    assert bind_default_group(gpu, world)
    assert world.bound_device_id == gpu and world.nccl.connected == [gpu]
    assert not bind_default_group(gpu, world)  # already bound (the trainer's init_process_group(device_id=))
    assert world.nccl.connected == [gpu]


def test_a_gloo_default_group_is_left_alone():
    world = _DefaultGroup("gloo")
    assert not bind_default_group(torch.device("cuda", 0), world)
    assert world.bound_device_id is None and world.nccl.connected == []


def test_the_gpu_environment_sets_only_what_the_user_left_unset(monkeypatch):
    for name in GPU_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's choice wins
    assert set(gpu_environment()) == set(GPU_ENVIRONMENT) - {"NCCL_NVLS_ENABLE"}
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ[distributed.SHARE_RESOURCES] == "1"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["NVTE_BATCH_MHA_P2P_COMM"] == "1"
    assert gpu_environment() == {}
