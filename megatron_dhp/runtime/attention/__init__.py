"""Dynamic context-parallel attention: pure math, one module per communication variant, the core module.

The names of the variants and layer specs live with the comm policy (`plan.comm`); the local kernels are
named here. Both are plain dicts, not the functions themselves, so that flags are validated without
importing megatron-core.
"""

BACKENDS: dict[str, str] = {
    "auto": "flash-attn on GPU when it applies, else sdpa",
    "math": "explicit softmax in fp32 (the reference)",
    "sdpa": "torch's fused attention, sample by sample",
    "flash": "flash-attn's varlen kernel (CUDA, bf16/fp16)",
}
"""Local attention kernels (see `kernels.attend`)."""
