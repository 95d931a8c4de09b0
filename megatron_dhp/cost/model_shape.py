"""The cost model of the job that runs, when no cost file is given: a measured model scaled to the job's GPT.

A preset's coefficients were measured on one model (`gpt7b-64`: a LLaMA-7B-shaped GPT on A100s). Another
transformer on the same GPUs spends time in proportion to its work, so each coefficient is scaled by the
ratio of the job's work to the reference model's, per position of the dynamic domain (one TP group):

- b, the linear seconds per token: the GEMM FLOPs a token takes (QKV, projection, MLP of every layer, and the
  output layer), over the TP ranks;
- a, the attention seconds per token²: query heads x head size x layers, over the TP ranks;
- gamma, the context-parallel bytes per token: the keys and values a token sends, kv heads per TP rank x head
  size x layers x bytes.

The microbatch overhead, the bandwidths, the encoder's terms and the memory cap stay the preset's. Scaling
assumes the GPUs, precision and kernels of the preset and ideal TP; the closed loop then corrects attention
and the rest from timed steps (docs/cost-model.md#calibration), and `megatron-dhp profile` measures instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.errors import DhpError


@dataclass(frozen=True)
class ModelShape:
    """What a GPT's time and bytes per token depend on (Megatron-LM's flags of the same names)."""

    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    query_groups: int
    """Key/value heads (`--num-query-groups` under `--group-query-attention`, else the heads)."""
    head_size: int
    """`--kv-channels`: each head's size."""
    vocab: int
    """The output layer's width (Megatron-LM's padded vocabulary); 0: not counted."""
    swiglu: bool = True
    element_bytes: int = 2
    """2 in bf16 or fp16, 4 in fp32."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn_hidden", "heads", "query_groups", "head_size", "element_bytes"):
            if getattr(self, name) < 1:
                raise DhpError(f"model {name} = {getattr(self, name)} must be >= 1")
        if self.vocab < 0:
            raise DhpError(f"model vocab = {self.vocab} must be >= 0 (0: not counted)")

    def linear_flops_per_token(self, tensor_parallel: int = 1) -> float:
        """Forward and backward GEMM FLOPs of one token on one TP rank: 6 x the weights it meets."""
        attention = self.hidden * self.head_size * (2 * self.heads + 2 * self.query_groups)  # QKV and projection
        mlp = (3 if self.swiglu else 2) * self.hidden * self.ffn_hidden
        return 6.0 * (self.layers * (attention + mlp) + self.hidden * self.vocab) / tensor_parallel

    def attention_per_token2(self, tensor_parallel: int = 1) -> float:
        """What attention's time per token² is proportional to on one TP rank: query heads x head size x layers."""
        return self.layers * self.heads * self.head_size / tensor_parallel

    def kv_bytes_per_token(self, tensor_parallel: int = 1) -> float:
        """The keys and values of one token on one TP rank, every layer (a TP rank keeps at least one kv head)."""
        groups = max(self.query_groups // tensor_parallel, 1)
        return 2.0 * groups * self.head_size * self.layers * self.element_bytes

    def describe(self, tensor_parallel: int = 1) -> str:
        """The shape in one phrase, for the start-up line."""
        groups = f" in {self.query_groups} groups" if self.query_groups != self.heads else ""
        precision = {2: "16-bit", 4: "fp32"}.get(self.element_bytes, f"{self.element_bytes}-byte")
        return (f"{self.layers} layers of {self.hidden}, FFN {self.ffn_hidden}{' SwiGLU' if self.swiglu else ''}, "
                f"{self.heads} heads{groups} of {self.head_size}, vocab {self.vocab}, {precision}, TP {tensor_parallel}")


GPT7B = ModelShape(layers=32, hidden=4096, ffn_hidden=11008, heads=32, query_groups=32, head_size=128, vocab=32000)
"""The model the `gpt7b-64` preset's coefficients describe (LLaMA-7B's shape, bf16, TP 1: 6.7B weights)."""


def scale_factors(shape: ModelShape, *, tensor_parallel: int = 1, reference: ModelShape = GPT7B) -> dict[str, float]:
    """The job's work over the reference model's (measured at TP 1): `linear`, `attention`, `comm`."""
    return {
        "linear": shape.linear_flops_per_token(tensor_parallel) / reference.linear_flops_per_token(),
        "attention": shape.attention_per_token2(tensor_parallel) / reference.attention_per_token2(),
        "comm": shape.kv_bytes_per_token(tensor_parallel) / reference.kv_bytes_per_token(),
    }


def scaled_cost(base: CostConfig, shape: ModelShape, *, tensor_parallel: int = 1,
                reference: ModelShape = GPT7B) -> tuple[CostConfig, dict[str, float]]:
    """`base` (measured on `reference` at TP 1) scaled to `shape` at `tensor_parallel`, and the factors applied
    (`scale_factors`)."""
    factors = scale_factors(shape, tensor_parallel=tensor_parallel, reference=reference)
    scaled = replace(base, linear_s_per_token=base.linear_s_per_token * factors["linear"],
                     attn_s_per_token2=base.attn_s_per_token2 * factors["attention"],
                     comm_bytes_per_token=base.comm_bytes_per_token * factors["comm"],
                     description=f"{base.description or 'cost preset'}, scaled to {shape.describe(tensor_parallel)}")
    return scaled, factors
