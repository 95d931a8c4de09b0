"""NVTX ranges: none without CUDA, balanced pushes and pops with it (counted per step in
tests/megatron/test_hooks_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_dhp.runtime import nvtx


def record(monkeypatch, *, on_gpu: bool) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(nvtx, "enabled", lambda: on_gpu)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda label: calls.append(label))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    return calls


def test_without_cuda_a_range_is_a_no_op(monkeypatch):
    calls = record(monkeypatch, on_gpu=False)
    with nvtx.nvtx_range(nvtx.PLAN_WAIT):
        pass
    assert calls == []


def test_with_cuda_each_range_is_pushed_and_popped_even_when_its_block_raises(monkeypatch):
    calls = record(monkeypatch, on_gpu=True)
    with nvtx.nvtx_range(nvtx.PLAN_WAIT):
        with pytest.raises(ValueError), nvtx.nvtx_range(nvtx.METADATA):
            raise ValueError
    assert calls == [nvtx.PLAN_WAIT, nvtx.METADATA, "pop", "pop"]


def test_enabled_follows_cuda():
    assert nvtx.enabled() == torch.cuda.is_available()
