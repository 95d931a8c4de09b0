"""Dynamic context-parallel attention: pure math, one module per communication variant, the core module.

The names of the variants and layer specs live with the comm policy (`plan.comm`); the local kernels are
named here. Both are plain dicts, not the functions themselves, so that flags are validated without
importing megatron-core.
"""

BACKENDS: dict[str, str] = {
    "auto": "varlen on a GPU in bf16/fp16, flex on a GPU in fp32, sdpa on a CPU",
    "math": "explicit softmax in fp32 (the reference)",
    "sdpa": "torch's fused attention, sample by sample (the CPU's)",
    "varlen": "torch's flash-attention varlen kernels (CUDA, bf16/fp16)",
    "flex": "FlexAttention, one block mask per microbatch (compiled on a GPU; forward only on a CPU)",
    "flash": "flash-attn's varlen kernel for whole samples (CUDA, bf16/fp16, pip install flash-attn)",
}
"""Local attention kernels (`kernels.kernel(name)` runs one; `kernels.resolve` picks one for `auto`)."""
