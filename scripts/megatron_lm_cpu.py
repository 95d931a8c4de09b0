"""Run a Megatron-LM checkout's pretrain_gpt.py on CPU gloo ranks (under torchrun): the CPU recipe of
docs/megatron-lm.md and the upstream tests.

Megatron-LM's training loop assumes CUDA in a few dozen places that have nothing to do with megatron-dhp:
the CUDA assert at start-up, fused-kernel compilation, the JIT warm-up, `.cuda()` moves, CUDA streams and
memory statistics, `device="cuda"` literals and a GPU-architecture probe. This shim answers each on the
CPU, then runs the script as `__main__`, so a test can compare a --dhp run with an upstream one.

    cd MEGATRON_LM && torchrun --nproc-per-node 4 /path/to/megatron-dhp/scripts/megatron_lm_cpu.py <pretrain_gpt.py flags>
"""

from __future__ import annotations

import contextlib
import functools
import os
import runpy
import sys

import torch

# modules with device="cuda" literals on the path of a small CPU run (moe_utils: the MoE metrics training logs)
TRAINING_MODULES = (
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.initialize",
    "megatron.training.global_vars",
    "megatron.training.theoretical_memory_usage",
    "megatron.training.checkpointing",
    "megatron.core.transformer.moe.moe_utils",
)


def answer_cuda_on_cpu() -> None:
    """Make Megatron-LM's CUDA assumptions hold on a CPU-only machine (megatron-core's shim first)."""
    from megatron_dhp.launch.cpu_shim import (
        apply_cpu_compat,
        backport_fsdp2_finish_grad_sync,
        redirect_cuda_literals,
    )

    apply_cpu_compat()
    torch.cuda.device_count = lambda: 1  # Megatron initialises model parallelism only "with devices"
    torch.cuda.set_device = lambda *_, **__: None
    torch.Tensor.cuda = lambda self, *_, **__: self
    torch.nn.Module.cuda = lambda self, *_, **__: self
    torch.cuda.stream = lambda *_, **__: contextlib.nullcontext()
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, stat, lambda *_, **__: 0)
    torch.cuda.empty_cache = lambda: None

    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    training.set_jit_fusion_options = lambda *_, **__: None  # warms up CUDA kernels
    with contextlib.suppress(ModuleNotFoundError):  # 0.16 compiles CUDA kernels at start-up; 0.19 has no legacy
        import megatron.legacy.fused_kernels as fused_kernels

        fused_kernels.load = lambda *_: None
    arguments.get_device_arch_version = lambda: 9  # reads the GPU's compute capability
    redirect_cuda_literals(TRAINING_MODULES)
    backport_fsdp2_finish_grad_sync()  # upstream's own FSDP2 step, on any hardware
    accept_is_loading()


def accept_is_loading() -> None:
    """megatron-core 0.16.1 cannot resume torch FSDP2 from a torch_dcp checkpoint: `load_checkpoint` asks
    `optimizer.state_dict(is_loading=True)` of a `ChainedOptimizer` whose `state_dict` takes no arguments."""
    import inspect

    from megatron.core.optimizer.optimizer import ChainedOptimizer

    state_dict = ChainedOptimizer.state_dict
    if "is_loading" not in inspect.signature(state_dict).parameters:
        ChainedOptimizer.state_dict = lambda self, is_loading=False: state_dict(self)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
    # MEGATRON_DHP_HOOKS=import: the launcher's in-memory hooks (python -m megatron_dhp.megatron.run) on an
    # unpatched checkout, installed before anything imports megatron.training
    if os.environ.get("MEGATRON_DHP_HOOKS") == "import":
        from megatron_dhp.megatron.run import install, run_script

        placements = install("pretrain_gpt.py")
        answer_cuda_on_cpu()
        run_script("pretrain_gpt.py", placements)
    else:
        answer_cuda_on_cpu()
        runpy.run_path("pretrain_gpt.py", run_name="__main__")
