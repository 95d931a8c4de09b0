"""Let megatron-core run on a machine without CUDA (gloo, CPU tensors).

megatron-core 0.16 hard-codes the CUDA device in a handful of places (RoPE frequencies, the DDP grad buffer,
the causal-mask helper, the schedules' token counter, the CUDA RNG tracker, the tied embedding's `.cuda()`
under pipeline parallelism), its CPU norm (torch's, without apex or TransformerEngine) refuses sequence
parallelism, and the distributed optimizer accepts only CUDA tensor types and, with torch's Adam and fp32
parameters, cannot load a checkpoint. On a CPU-only machine those
calls fail before any math runs, so a job that starts on the CPU (a gloo trainer rank, `selftest`, the test
workers) switches this on first, explicitly; no library call does it for them. Nothing is changed when CUDA
is available: a GPU run uses megatron-core exactly as shipped.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import types
from collections.abc import Iterable
from typing import Any

import torch

_APPLIED = False

# megatron.core modules that build tensors with a literal `device="cuda"`; each gets a `torch` whose
# tensor factories map that device to the CPU. Missing modules (older or newer releases) are skipped.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint")


class _NullStream:
    """Stands in for `torch.cuda.current_stream()` and for `torch.cuda.Stream` itself (a type, so annotations such as
    megatron-core 0.20's `torch.cuda.Stream | None` still evaluate): synchronisation is a no-op on the CPU."""

    def __init__(self, *_: Any, **__: Any) -> None:
        """Any stream arguments (device, priority) mean nothing on the CPU."""

    def wait_stream(self, *_: Any) -> None:
        """No-op: CPU work is already ordered."""

    def wait_event(self, *_: Any) -> None:
        """No-op: CPU work is already ordered."""

    def synchronize(self) -> None:
        """No-op: CPU work is already ordered."""

    def record_event(self, *_: Any) -> _NullStream:
        """Itself, as an event whose `synchronize` is a no-op (the MoE dispatcher waits on one)."""
        return self


def _cpu_device(device: Any) -> Any:
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda:"):
        return "cpu"
    return device


def _cpu_factory(fn: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapped


class _CpuTorch(types.ModuleType):
    """`torch`, except that tensor factories put `device="cuda"` tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def apply_cpu_compat() -> bool:
    """Redirect megatron-core's hard-coded CUDA device to the CPU; returns whether anything was patched.

    Idempotent. Does nothing when CUDA is available, so it is safe to call unconditionally at start-up.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *_, **__: _NullStream()
    torch.cuda.default_stream = lambda *_, **__: _NullStream()
    torch.cuda.synchronize = lambda *_, **__: None
    torch.cuda.is_current_stream_capturing = lambda: False  # the dev branch's p2p asks before each send
    # The MoE all-to-all dispatcher copies its split sizes to the host on a side stream.
    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda *_, **__: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    # The "CUDA" RNG is the CPU generator, so megatron's RNG tracker forks and restores real states.
    # (`torch.manual_seed` itself calls `torch.cuda.manual_seed_all`, which therefore stays untouched.)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    # Under pipeline parallelism the tied embedding's initial sync moves the weight with `.cuda()`
    # (language_module.py) before all-reducing it between the first and last stage; on the CPU it stays put.
    torch.Tensor.cuda = lambda self, *_, **__: self

    from megatron.core.tensor_parallel import random as mc_random

    mc_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    mc_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()

    # Without apex or TransformerEngine megatron-core's norm is torch's, which refuses sequence parallelism only
    # because nothing marks its weights for the TP all-reduce of their gradients, as apex's and TE's norms do.
    from megatron.core.transformer import torch_norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(_marking_sequence_parallel(torch_norm.WrappedTorchNorm.__new__))
    # The distributed optimizer sorts parameters by their CUDA type names while it builds its groups.
    from megatron.core.optimizer import distrib_optimizer

    optimizer = distrib_optimizer.DistributedOptimizer
    build, sharded = optimizer.__init__, optimizer.sharded_state_dict
    optimizer.__init__ = lambda *a, **k: _with_cuda_type_names(build, *a, **k)
    # Loading a checkpoint asks the optimizer for its state before any step; apex's and TE's Adam have one
    # from the start, torch's only after a step, so it is filled with dummies first (as megatron-core does for
    # Megatron-FSDP checkpoints); the load then overwrites them.
    optimizer.sharded_state_dict = lambda self, model_state={}, is_loading=False, *a, **k: sharded(  # noqa: B006
        _with_optimizer_state(self) if is_loading else self, model_state, is_loading, *a, **k)
    # With fp32 parameters the main parameter is the model's own (a leaf that requires grad), which loading
    # copies into; the copy must not be recorded by autograd.
    optimizer._set_main_param_and_optimizer_states = torch.no_grad()(optimizer._set_main_param_and_optimizer_states)

    # MLA's and the MoE router's names that only TransformerEngine defines (on a GPU without TE too).
    from megatron_dhp.runtime import without_te

    without_te.install()
    # The all-to-all dispatcher's split sizes become host lists only when they are copied off a GPU; on the
    # CPU they would stay tensors, which `all_to_all_single` does not accept as split sizes.
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy

    # Interleaved 1F1B with overlapped p2p frees an output (`deallocate_output_tensor`, Megatron-LM's default)
    # right after posting its send: on a GPU the caching allocator holds the block until the NCCL stream has
    # read it, but gloo's send reads host memory on its own thread, which may then read freed memory (wrong
    # activations, measured). On the CPU the freed output keeps its old memory alive until its backward.
    from megatron.core.pipeline_parallel import schedules

    schedules.deallocate_output_tensor = _keeping_sent_memory(schedules.deallocate_output_tensor)

    # Fully sharded data parallelism asks for a high-priority NCCL stream on the data-parallel group (a
    # CPU build of torch has no ProcessGroupNCCL) and builds torch FSDP2's device mesh on "cuda".
    from megatron.core import parallel_state

    if not hasattr(torch.distributed, "ProcessGroupNCCL"):
        parallel_state.get_nccl_options = lambda *_, **__: None
    with contextlib.suppress(ImportError):
        from megatron.core.distributed import torch_fully_sharded_data_parallel as torch_fsdp

        mesh = torch.distributed.DeviceMesh
        torch_fsdp.DeviceMesh = types.SimpleNamespace(
            from_group=lambda group, device_type, *a, **k: mesh.from_group(group, "cpu", *a, **k))

    redirect_cuda_literals(_MODULES_WITH_CUDA_LITERALS)
    _APPLIED = True
    return True


def backport_fsdp2_finish_grad_sync() -> None:
    """Not a CPU matter: megatron-core 0.16.1's torch FSDP2 wrapper cannot finish a step on any hardware, since
    `finalize_model_grads` passes `force_all_reduce` to a `finish_grad_sync` that takes no arguments (a
    TypeError). 0.19 added the argument (and ignores it); this gives 0.16.1's the same signature. Idempotent."""
    import inspect

    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    finish = _BaseDataParallel.finish_grad_sync
    if "force_all_reduce" not in inspect.signature(finish).parameters:
        _BaseDataParallel.finish_grad_sync = lambda self, force_all_reduce=False: finish(self)


def _keeping_sent_memory(deallocate: Any) -> Any:
    """megatron's pseudo-deallocation of a sent output, holding the old memory on the tensor for gloo's send (a
    tensor, or from megatron-core 0.19 on a list or dict of them)."""

    def hold(out: Any) -> None:
        if isinstance(out, dict):
            out = list(out.values())
        if isinstance(out, (list, tuple)):
            for tensor in out:
                hold(tensor)
        elif out is not None:
            out.sent_memory = out.data

    def deallocate_after_send(out: Any, deallocate_pipeline_outputs: bool = False) -> None:
        if deallocate_pipeline_outputs:
            hold(out)
        deallocate(out, deallocate_pipeline_outputs)

    return deallocate_after_send


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron-core's `maybe_move_tensor_to_cpu` for CPU tensors: a numpy array when asked for one."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _with_cuda_type_names(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call `fn` while a CPU tensor's `type()` answers with its CUDA name ('torch.cuda.FloatTensor')."""
    plain = torch.Tensor.type

    def cuda_named(self: torch.Tensor, dtype: Any = None, *rest: Any, **options: Any) -> Any:
        name = plain(self, dtype, *rest, **options)
        return name.replace("torch.", "torch.cuda.", 1) if dtype is None and self.device.type == "cpu" else name

    torch.Tensor.type = cuda_named
    try:
        return fn(*args, **kwargs)
    finally:
        torch.Tensor.type = plain


def _with_optimizer_state(optimizer: Any) -> Any:
    """The distributed optimizer, its inner torch optimizer given (dummy) state if it has none yet."""
    if not optimizer.optimizer.state:
        optimizer._init_optimizer_states_with_dummy_values()
    return optimizer


def _marking_sequence_parallel(build: Any) -> Any:
    """megatron-core's torch-norm constructor, accepting sequence parallelism: its parameters are marked
    `sequence_parallel`, so `finalize_model_grads` sums their gradients over the TP ranks' sequence shards."""

    def norm(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        module = build(cls, plain, *args, **kwargs)
        for param in module.parameters():
            param.sequence_parallel = True
        return module

    return norm


def redirect_cuda_literals(module_names: Iterable[str]) -> None:
    """Give each module a `torch` whose tensor factories put `device="cuda"` tensors on the CPU.

    For code beyond megatron-core that a CPU run also imports (e.g. Megatron-LM's `megatron.training`).
    Missing modules are skipped.
    """
    cpu_torch = _CpuTorch()
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = cpu_torch
