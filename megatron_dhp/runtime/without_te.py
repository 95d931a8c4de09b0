"""megatron-core 0.16.1 without TransformerEngine, on any device: two of its modules read names that only
TransformerEngine's import defines.

- The MoE router's gating GEMM tests `te_general_gemm is not None` (`moe_utils`); without TE the name is
  undefined, so the router fails with a NameError (0.17.1 and later define it as None).
- Multi-latent attention tests `isinstance(self.linear_proj, TELinear)` whenever its TE import did not fail,
  which it does not without TE (megatron's extension module stands mocks in for the classes): a TypeError.

`install` gives each the value megatron-core's own fallback expects. Idempotent; every dynamic-CP layer spec
calls it (`runtime.layer_spec.with_dynamic_cp`), the CPU shim too. With TransformerEngine it changes nothing.
"""

from __future__ import annotations


def install() -> None:
    """Define the names megatron-core reads without TransformerEngine (see the module docstring)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
