"""The layer spec that puts dynamic-CP attention into a megatron-core GPT, and what its sequence parallelism
asks of the layout.

Integration is one entry in megatron-core's own layer spec: the self-attention module (so RoPE follows the
dynamic group) and its core attention. Everything else is megatron-core as shipped.
"""

from __future__ import annotations

import argparse
import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.comm import LAYER_SPECS
from megatron_dhp.runtime import rope, without_te
from megatron_dhp.runtime.attention.core_attention import (
    DynamicCPAttention,
    DynamicCPMLASelfAttention,
    DynamicCPSelfAttention,
)
from megatron_dhp.runtime.attention.te import dynamic_te_attention


def dhp_layer_spec(*, backend: str = "local", **spec_kwargs: object) -> ModuleSpec:
    """megatron-core's GPT layer spec with dynamic context-parallel attention.

    `local`: megatron's local spec with `DynamicCPAttention` as core attention (any device; the CPU
    reference). `te`: the TransformerEngine spec, whose `TEDotProductAttention` runs context parallelism over
    the group it receives per microbatch in `PackedSeqParams.cp_group` (GPU with TE installed; the job's
    `cp_comm_type` and each microbatch's padding stated, `attention.te`). In both, the self-attention module
    is `DynamicCPSelfAttention`, so RoPE uses the same group.
    """
    _check_backend(backend)
    if backend == "local":
        return with_dynamic_cp(get_gpt_layer_local_spec(**spec_kwargs), backend=backend)
    _require_te()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return with_dynamic_cp(get_gpt_layer_with_transformer_engine_spec(**spec_kwargs), backend=backend)


def with_dynamic_cp(spec: ModuleSpec, *, backend: str) -> ModuleSpec:
    """A copy of a GPT layer spec (megatron's local or TE one, or a user's) with dynamic-CP attention.

    The self-attention module becomes `DynamicCPSelfAttention`; `local` also swaps the core attention for
    `DynamicCPAttention` (whatever the linear layers are), `te` keeps `TEDotProductAttention`. A decoder
    block spec (megatron's MoE and heterogeneous models: one spec per layer) has each layer's swapped.
    """
    _check_backend(backend)
    rope.install()
    without_te.install()
    spec = copy.deepcopy(spec)
    for layer in spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]:
        _swap_attention(layer, backend)
    return spec


def mtp_block_spec(spec: ModuleSpec | TransformerBlockSubmodules, num_layers: int, *, last_stage: bool = True):
    """megatron-core's multi-token prediction block on `spec`'s (last) layer, `num_layers` deep, for the last
    pipeline stage (None elsewhere, and for no layers): a dynamic-CP spec gives MTP layers dynamic-CP attention,
    and megatron-core's token roll follows megatron-dhp's layout (`runtime.mtp`). Built from the stage it is
    told rather than megatron's parallel state, so a single-process oracle builds it too."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )

    from megatron_dhp.runtime import mtp

    if not num_layers or not last_stage:
        return None
    mtp.install()
    layer = spec.layer_specs[-1] if isinstance(spec, TransformerBlockSubmodules) else spec
    return MultiTokenPredictionBlockSubmodules(
        layer_specs=[get_mtp_layer_spec_for_backend(transformer_layer_spec=layer, backend=LocalSpecProvider())] * num_layers)


def dynamic_mtp_blocks(backend: str) -> None:
    """Make megatron-core's MTP block specs (`get_gpt_mtp_block_spec_for_backend`, which Megatron-LM's GPT
    builder calls on a decoder layer spec of its own, not the one `with_dynamic_cp` swapped) take dynamic-CP
    attention, and its token roll megatron-dhp's layout (`runtime.mtp`). Idempotent; call before the model
    is built."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_dhp.runtime import mtp

    mtp.install()
    build = gpt_layer_specs.get_gpt_mtp_block_spec_for_backend
    if getattr(build, "dhp_backend", None) == backend:
        return
    original = getattr(build, "__wrapped__", build)

    def dynamic(config, spec, *args, **kwargs):
        return original(config, with_dynamic_cp(spec, backend=backend), *args, **kwargs)

    dynamic.__wrapped__, dynamic.dhp_backend = original, backend
    gpt_layer_specs.get_gpt_mtp_block_spec_for_backend = dynamic


def _swap_attention(spec: ModuleSpec, backend: str) -> None:
    """`with_dynamic_cp` on one layer spec, in place (idempotent: layers may share one spec object)."""
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    module = getattr(attention, "module", None)
    dynamic = next((d for base, d in _DYNAMIC.items() if isinstance(module, type) and issubclass(module, base)), None)
    if not isinstance(attention, ModuleSpec) or dynamic is None:
        raise DhpError(
            f"dynamic CP needs a GPT layer spec whose self_attention is megatron's SelfAttention or MLASelfAttention, "
            f"got {getattr(attention, 'module', attention)!r}; use a standard GPT layer or decoder block spec"
        )
    if backend == "local":
        attention.submodules.core_attention = DynamicCPAttention
    else:
        if dynamic is DynamicCPMLASelfAttention:
            raise DhpError("multi-latent attention under layer_spec 'te' is not verified (no GPU here); use "
                           "layer_spec 'local'")
        te_attention = _require_te()
        core = attention.submodules.core_attention
        if not (isinstance(core, type) and issubclass(core, te_attention)):
            raise DhpError(
                f"layer spec 'te' needs TEDotProductAttention as core attention, the spec has "
                f"{core!r}; build it with --transformer-impl transformer_engine"
            )
        if not getattr(core, "dhp_dynamic", False):
            attention.submodules.core_attention = dynamic_te_attention(core)
    attention.module = dynamic


_DYNAMIC = {MLASelfAttention: DynamicCPMLASelfAttention, SelfAttention: DynamicCPSelfAttention}
"""Megatron's self-attention modules and their dynamic-CP subclasses (a subclass, a swapped spec's among them,
maps as its base does)."""


def _check_backend(backend: str) -> None:
    if backend not in LAYER_SPECS:
        raise DhpError(f"layer-spec backend {backend!r} is unknown; use {' or '.join(map(repr, LAYER_SPECS))}")


def _require_te() -> type:
    """TE's core attention class, with the CP stream that static CP 1 never allocates."""
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError as e:
        raise DhpError(f"the 'te' layer spec needs TransformerEngine ({e}); install it or use backend='local'") from None
    if not torch.cuda.is_available():
        raise DhpError("the 'te' layer spec needs a CUDA device; use backend='local' on CPU")
    # megatron-core only allocates TE's CP stream when the static CP size is > 1; dynamic groups run with
    # static CP 1, so it would stay None and TE would fail on the first dynamic group (Megatron-LM #6821).
    if TEDotProductAttention.cp_stream is None:
        TEDotProductAttention.cp_stream = torch.cuda.Stream()
    return TEDotProductAttention


def seq_multiple(config: TransformerConfig | argparse.Namespace) -> int:
    """What each sample's shard must divide by (`layout`): the TP size under sequence parallelism, else 1.
    Megatron-LM's parsed args name both settings as the model config does."""
    return config.tensor_model_parallel_size if config.sequence_parallel else 1
