"""Dynamic context-parallel attention: pure math, one module per communication variant, the core module.

The names below are plain constants so that the CLI can validate flags without importing megatron-core.
"""

COMM_VARIANTS = ("allgather", "ring", "ulysses")
"""K/V all-gather (dK/dV reduce-scatter), P2P ring of K/V blocks, Ulysses all-to-all of heads."""
BACKENDS = ("auto", "math", "sdpa", "flash")
"""Local attention kernels (see `kernels.attend`)."""
