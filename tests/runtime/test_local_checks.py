"""User errors the runtime must catch without any process group (so: before any collective)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.group_pool import GroupPool
from megatron_dhp.runtime.step_data import TokenSample
from megatron_dhp.testing.dispatch import dispatch
from megatron_dhp.workload.sample import Sample


def domain_of(size: int, rank: int = 0) -> DynamicDomain:
    ranks = tuple(range(size))
    return DynamicDomain(global_ranks=ranks, rank=rank, all_domains=(ranks,))


def sample(i: int, n: int) -> TokenSample:
    return TokenSample(i, torch.arange(n), torch.arange(n), torch.ones(n))


def test_plan_for_another_world_size_is_rejected_before_any_collective():
    assert not dist.is_initialized()  # any collective would fail with torch's own error, not DhpError
    plan = Plan("p", 3, 3, (Sample(0, 4),), (PlanGroup((0, 1, 2), ((0,),)),))
    with pytest.raises(DhpError, match="plan is for a domain of 3 ranks but this domain has 4"):
        dispatch([sample(0, 4)], domain_of(4), plan=plan)


def test_dispatch_needs_exactly_one_plan_source():
    with pytest.raises(DhpError, match="exactly one of plan= or planner="):
        dispatch([], domain_of(2))


def test_token_sample_shapes_are_checked():
    with pytest.raises(DhpError, match="labels has shape"):
        TokenSample(3, torch.arange(4), torch.arange(5), torch.ones(4))
    with pytest.raises(DhpError, match="non-empty 1-D"):
        TokenSample(3, torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(0))


def test_domain_is_validated():
    with pytest.raises(DhpError, match="distinct and increasing"):
        DynamicDomain(global_ranks=(2, 0), rank=0, all_domains=((2, 0),))
    with pytest.raises(DhpError, match="not in its domain"):
        DynamicDomain(global_ranks=(0, 2), rank=1, all_domains=((0, 2), (1, 3)))
    d = DynamicDomain(global_ranks=(1, 3), rank=3, all_domains=((0, 2), (1, 3)))
    assert d.size == 2 and d.position == 1


def test_pool_lookups_without_prepare():
    pool = GroupPool(domain_of(4, rank=1))
    assert pool.get((1,)) is None  # a one-rank group needs no communicator
    with pytest.raises(DhpError, match="was not prepared"):
        pool.get((1, 2))
    with pytest.raises(DhpError, match="position 1 is not in group"):
        pool.get((0, 2))
    with pytest.raises(DhpError, match="max_groups"):
        GroupPool(domain_of(2), max_groups=0)


def test_attention_and_spec_reject_what_they_cannot_run():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dhp.models.gpt import TinyGPTConfig
    from megatron_dhp.runtime.attention.core_attention import DynamicCPAttention
    from megatron_dhp.runtime.layer_spec import dhp_layer_spec

    config = TinyGPTConfig().transformer_config()
    config.attention_dropout = 0.1
    with pytest.raises(DhpError, match="attention_dropout=0.1"):
        DynamicCPAttention(config, 1, AttnMaskType.causal, "self")
    with pytest.raises(DhpError, match="causal self-attention only"):
        DynamicCPAttention(TinyGPTConfig().transformer_config(), 1, AttnMaskType.no_mask, "self")
    with pytest.raises(DhpError, match="layer-spec backend 'bogus'"):
        dhp_layer_spec(backend="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(DhpError, match="'te' layer spec"):
            dhp_layer_spec(backend="te")


def test_cpu_compat_is_idempotent_and_only_acts_without_cuda():
    from megatron_dhp.launch.cpu_shim import apply_cpu_compat

    if torch.cuda.is_available():
        assert apply_cpu_compat() is False
        return
    assert apply_cpu_compat() is True and apply_cpu_compat() is True
    assert torch.cuda.current_device() == "cpu"
    from megatron.core.transformer.utils import get_default_causal_mask

    assert get_default_causal_mask(3).device.type == "cpu"  # a literal device="cuda" inside megatron-core


def test_loss_mask_must_be_binary():
    with pytest.raises(DhpError, match="loss_mask must hold only 0 and 1"):
        TokenSample(1, torch.arange(3), torch.arange(3), torch.tensor([1.0, 0.5, 0.0]))


def test_the_start_up_note_says_whether_nccl_groups_share_resources(monkeypatch):
    from types import SimpleNamespace

    from megatron_dhp.runtime import group_pool

    assert group_pool.nccl_sharing() is None  # no process group here
    fake = SimpleNamespace(is_initialized=lambda: True, get_backend=lambda: "nccl",
                           group=SimpleNamespace(WORLD=SimpleNamespace(bound_device_id=None)))
    monkeypatch.setattr(group_pool, "dist", fake)
    monkeypatch.delenv(group_pool.SHARE_RESOURCES, raising=False)
    note = group_pool.nccl_sharing()
    assert note.startswith("NCCL: groups not split") and "device_id" in note and "NCCL_COMM_SPLIT_SHARE_RESOURCES=1" in note
    fake.group.WORLD.bound_device_id = "cuda:0"
    monkeypatch.setenv(group_pool.SHARE_RESOURCES, "1")
    assert group_pool.nccl_sharing() == "NCCL: groups split from the default communicator, sharing its resources"


def test_aux_loss_scales_sit_on_the_models_device():
    """megatron-core's MoE and MTP scalers multiply their scale with the loss's gradient in backward; a 1-D scale
    on another device is refused there (the CPU one before a GPU model: shown here with a `meta` model)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from megatron_dhp.runtime.step import scale_aux_losses

    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1)  # a scale left on the host by an earlier step
    scale_aux_losses(4, torch.device("meta"))
    for scaler in (MoEAuxLossAutoScaler, MTPLossAutoScaler):
        assert scaler.main_loss_backward_scale.device.type == "meta"
    out = torch.empty(3, device="meta", requires_grad=True)
    aux = torch.empty((), device="meta", requires_grad=True)
    MoEAuxLossAutoScaler.apply(out, aux).sum().backward()  # raises with a scale on another device
    assert aux.grad is not None and aux.grad.device.type == "meta"
    scale_aux_losses(4, torch.device("cpu"))


def test_a_sent_pipeline_output_keeps_its_memory_for_gloo_in_every_form_megatron_passes():
    """megatron-core pseudo-deallocates an output once sent; gloo's send may still be reading it, so the CPU shim
    keeps the old memory on the tensor: a tensor (0.16), a list or a dict of them (0.19 onwards)."""
    from megatron_dhp.launch.cpu_shim import _keeping_sent_memory

    def deallocate(out, deallocate_pipeline_outputs=False):
        for tensor in out.values() if isinstance(out, dict) else out if isinstance(out, list) else [out]:
            tensor.data = torch.empty(1)

    deallocate_after_send = _keeping_sent_memory(deallocate)
    one, two, three = (torch.arange(4.0) + i for i in range(3))
    for out, tensors in ((one, [one]), ([two], [two]), ({"decoder": three}, [three])):
        deallocate_after_send(out, True)
        assert all(t.numel() == 1 and t.sent_memory.numel() == 4 for t in tensors)
    kept = torch.arange(4.0)
    deallocate_after_send(kept, False)
    assert not hasattr(kept, "sent_memory")


def test_the_cpu_shim_keeps_torch_cuda_stream_a_type():
    """megatron-core 0.20 annotates `torch.cuda.Stream | None` at import: the shim's stand-in must stay a type."""
    code = ("import torch\nfrom megatron_dhp.launch.cpu_shim import apply_cpu_compat\napply_cpu_compat()\n"
            "assert isinstance(torch.cuda.Stream | None, object) and torch.cuda.Stream(priority=-1) is not None\n"
            "torch.cuda.Stream().wait_stream(torch.cuda.current_stream())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_megatron_core_whose_mtp_roll_takes_lists_is_refused_in_one_line(monkeypatch):
    """The dev branch's `roll_tensor(tensors, ..., fill_values=...)`: megatron-dhp's token roll follows the
    one-tensor form of megatron-core 0.16 to 0.20, so MTP under --dhp stops before the model is built."""
    from megatron.core.transformer import multi_token_prediction

    from megatron_dhp.runtime import mtp

    def roll_lists(tensors, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None, fill_values=None):
        return tensors

    monkeypatch.setattr(multi_token_prediction, "roll_tensor", roll_lists)
    with pytest.raises(DhpError, match=r"--mtp-num-layers with --dhp: this megatron-core's "
                       r"megatron.core.transformer.multi_token_prediction.roll_tensor takes 'tensors' \(a list"):
        mtp.install()
