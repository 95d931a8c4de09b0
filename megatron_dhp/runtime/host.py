"""Host-to-device copies that do not make the host wait.

A copy from pageable host memory to a CUDA device first synchronises the stream (CUDA stages it through a
pinned buffer only after the work before it is done); a copy from pinned memory is asynchronous. Everything
megatron-dhp moves to the device per microbatch (its tokens, its attention metadata, the zigzag tables) goes
through `to_device`.
"""

from __future__ import annotations

import torch


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`x` on `device`, from pinned memory and non-blocking when it goes from the host to a CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
