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

STEP_COMMS: dict[str, str] = {
    **COMM_VARIANTS,
    "mixed": "allgather on the group family's communicators (created at start-up); any other group runs the p2p "
             "ring on the domain's communicator",
}
"""What a step may run: one variant for every group, or `mixed`, which the engine resolves group by group
(`StepEngine.slot`) so that the planner may use any group while no step creates a communicator."""

ANY_GROUP_COMMS: frozenset[str] = frozenset({"p2p", "mixed"})
"""Step comms under which a group outside the family costs no new communicator: the planner is not held to
the family under them (with megatron-dhp's local layer spec; TransformerEngine needs a process group)."""

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
"""Which core attention the layer spec holds (see `runtime.layer_spec.dhp_layer_spec`)."""
