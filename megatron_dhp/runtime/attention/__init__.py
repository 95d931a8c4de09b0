"""Dynamic context-parallel attention: pure math, one module per communication variant, the core module.

The registries below name every choice a user can make; the CLI, `DhpConfig`, Megatron's flags and the
modules that implement the choices all derive from them. They are plain dicts here, not the functions
themselves, so that flags are validated without importing megatron-core.
"""

COMM_VARIANTS: dict[str, str] = {
    "allgather": "K/V all-gather, dK/dV reduce-scatter",
    "ring": "P2P ring of K/V blocks",
    "ulysses": "Ulysses all-to-all of heads",
    "p2p": "ring of K/V blocks by point-to-point on the domain's communicator: no communicator per group",
}
"""Context-parallel communication inside a group (`core_attention.VARIANTS` holds one function per name)."""

DOMAIN_COMMS: frozenset[str] = frozenset({"p2p"})
"""Variants that address a group's members by global rank on the domain's own communicator
(`comm.PeerRing`), so the engine creates no process group for them; the others get one per group."""

BACKENDS: dict[str, str] = {
    "auto": "flash-attn on GPU when it applies, else sdpa",
    "math": "explicit softmax in fp32 (the reference)",
    "sdpa": "torch's fused attention, sample by sample",
    "flash": "flash-attn's varlen kernel (CUDA, bf16/fp16)",
}
"""Local attention kernels (see `kernels.attend`)."""

LAYER_SPECS: dict[str, str] = {
    "local": "megatron-dhp's core attention (any device, any linear layers)",
    "te": "TransformerEngine's core attention (GPU; --transformer-impl transformer_engine)",
}
"""Which core attention the layer spec holds (see `runtime.model.dhp_layer_spec`)."""
