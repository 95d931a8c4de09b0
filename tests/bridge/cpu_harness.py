"""What megatron-bridge 0.6.2 needs to run on a CPU-only machine (gloo, no TransformerEngine): test harness only.

`require_bridge` skips a test module where Bridge cannot be imported, naming the module that is missing.

Two imports are stubbed, each for one importing module alone (`_SCOPED_STUBS`): LoRA's TransformerEngine layers,
which pretraining never builds, and `pretrain.py`'s in-process-restart wrapper, which it uses only when
`inprocess_restart` is enabled. Bridge's hard-coded CUDA calls (the CUDA assert of `initialize_megatron`, a
`device="cuda"` start-time tensor, cache and memory queries, the dataset helper's `make`, the RNG seeding that counts CUDA devices) go to the CPU on top of megatron-dhp's
`apply_cpu_compat` for megatron-core. Nothing here is used by `megatron_dhp/`.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import types
from typing import Any

import pytest
import torch

BRIDGE_MODULES = (
    "megatron.bridge.training.pretrain",
    "megatron.bridge.models.conversion.auto_bridge",
    "megatron.bridge.recipes.common",
    "megatron.bridge.training.utils.omegaconf_utils",
)
"""The Bridge modules the tests import (and, through them, what Bridge imports of its dependencies)."""

_SCOPED_STUBS = {
    ("megatron.bridge.peft.lora_layers", "transformer_engine.pytorch"),
    ("megatron.bridge.training.pretrain", "nvidia_resiliency_ext.inprocess"),
}
"""(importing module, module it imports) pairs answered with a stub; every other import is untouched."""

_BRIDGE_MODULES_WITH_CUDA_LITERALS = (
    "megatron.bridge.data.loaders",
    "megatron.bridge.training.eval",
    "megatron.bridge.training.initialize",
    "megatron.bridge.training.setup",
    "megatron.bridge.training.train",
    "megatron.bridge.training.utils.train_utils",
)
"""Bridge modules of the pretraining path that build tensors with `device="cuda"`; each gets the shim's `torch`."""


class _Stub(types.ModuleType):
    """A module whose every attribute is a placeholder class (for names used only in annotations or isinstance)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Stub(name) if name.islower() else type(name, (), {})
        setattr(self, name, value)
        return value


def _scoped_import(original):
    @functools.wraps(original)
    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and globals and (globals.get("__name__"), name) in _SCOPED_STUBS:
            return _Stub(name.partition(".")[0])
        return original(name, globals, locals, fromlist, level)

    importer.scoped_stubs = True
    return importer


def stub_imports() -> None:
    """Answer the two scoped imports with stubs (every other import untouched). Idempotent."""
    if not getattr(builtins.__import__, "scoped_stubs", False):
        builtins.__import__ = _scoped_import(builtins.__import__)


def require_bridge() -> None:
    """Skip the calling test module unless `BRIDGE_MODULES` import; the reason names the module that is missing
    (megatron-bridge itself, or one of its dependencies that a `--no-deps` install leaves out)."""
    stub_imports()
    for name in BRIDGE_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = e.name or name
            if missing in ("megatron", "megatron.bridge"):
                reason = "megatron-bridge is not installed (docs/bridge.md#install: 0.6.2, Python 3.12)"
            else:
                reason = (f"megatron-bridge is installed, but importing {name} needs {missing!r}, which is not installed "
                          "(docs/bridge.md#install)")
            pytest.skip(reason, allow_module_level=True)


def apply_bridge_cpu_compat() -> None:
    """Stub the two imports, run megatron-core on the CPU, and send Bridge's CUDA calls to the CPU. Idempotent."""
    from megatron_dhp.launch.cpu_shim import _CpuTorch, apply_cpu_compat

    stub_imports()
    # before the shim: transformers writes `torch.cuda.Stream | None` at import, which the shim's stand-in breaks
    importlib.import_module("megatron.bridge.training.pretrain")
    importlib.import_module("megatron.bridge.models.conversion.auto_bridge")
    apply_cpu_compat()
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *_, **__: 0
    torch.cuda.max_memory_allocated = lambda *_, **__: 0
    torch.cuda.memory_reserved = lambda *_, **__: 0
    torch.cuda.max_memory_reserved = lambda *_, **__: 0
    torch.cuda.reset_peak_memory_stats = lambda *_, **__: None
    for name in _BRIDGE_MODULES_WITH_CUDA_LITERALS:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = _CpuTorch()
    from megatron.bridge.training import initialize, setup

    setup.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    # megatron-core's dataset helper ships compiled here; Bridge would run `make` for it (no compiler needed)
    initialize.compile_helpers = lambda: None
    initialize._set_random_seed = _with_one_device(initialize._set_random_seed)


def _with_one_device(seed_function):
    """Bridge seeds megatron-core's model-parallel RNG tracker only when it counts a CUDA device; the shim's "CUDA"
    RNG is the CPU generator, so the seeding runs as on a GPU."""

    @functools.wraps(seed_function)
    def seeded(*args: Any, **kwargs: Any) -> None:
        count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            seed_function(*args, **kwargs)
        finally:
            torch.cuda.device_count = count

    return seeded


def cpu_config(cfg: Any) -> Any:
    """A Bridge recipe as the CPU runs it: fp32, megatron-core's local layers (no TransformerEngine, no fused
    kernels), gloo, plain DDP without overlap, one dataloader process. Returns `cfg`, changed in place."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    model = cfg.model
    model.transformer_impl = "local"
    model.transformer_layer_spec = local_layer_spec
    for fusion in ("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion",
                   "apply_rope_fusion", "cross_entropy_loss_fusion", "gradient_accumulation_fusion"):
        setattr(model, fusion, False)
    cfg.mixed_precision = None
    model.bf16 = model.fp16 = False
    model.params_dtype = model.pipeline_dtype = torch.float32
    cfg.optimizer.bf16 = cfg.optimizer.fp16 = False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False
    cfg.ddp.grad_reduce_in_fp32 = True
    cfg.optimizer.clip_grad = 0.0  # megatron-core clips CUDA float tensors only
    cfg.dist.distributed_backend = "gloo"
    cfg.rerun_state_machine.check_for_nan_in_loss = False
    return cfg
