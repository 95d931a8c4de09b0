"""Megatron-LM's packed (THD) SFT path on a CPU, as the reference a `--sft --dhp` run is compared with.

Upstream's `pretrain_gpt.py --sft` hands the model each row's `cu_seqlens` as THD `PackedSeqParams`; on a CPU
(core_v0.16.1, the local spec, no TransformerEngine) two pieces then stop it, with or without megatron-dhp:

- the loader collates `cu_seqlens` to [1, n] (micro-batch size 1) and `get_batch` hands it on as it is, so RoPE's
  THD path (`rope_utils._apply_rotary_pos_emb_thd`) asks `freqs.size(0) == cu_seqlens[-1]` of a whole row and
  raises "Boolean value of Tensor with more than one value is ambiguous";
- `DotProductAttention.forward` asserts `packed_seq_params is None` ("Packed sequence is not supported by
  DotProductAttention. Please use TEDotProductAttention instead.").

`install` answers both, with upstream's own code: `get_thd_batch_on_this_cp_rank` gets the row's boundaries as
the 1-D tensor its docstring asks for, and the local attention runs each sequence between two boundaries as a
batch of one (causal, the mask its softmax builds), which is what TransformerEngine's THD attention computes.
Everything else (the SFT dataset and its padding, the loss and its mask, the training loop) is upstream's.

    torchrun --nproc-per-node 4 megatron_dhp/testing/thd_reference.py <pretrain_gpt.py flags>   (in a checkout)
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from pathlib import Path

import torch

CPU_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "megatron_lm_cpu.py"


def install() -> None:
    """Let megatron-core's THD path run on a CPU (see the module docstring); call before pretrain_gpt.py runs."""
    import megatron.core.utils as core_utils
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    thd_batch = core_utils.get_thd_batch_on_this_cp_rank

    def flat_thd_batch(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, *args, **kwargs):
        padded = None if cu_seqlens_padded is None else cu_seqlens_padded.view(-1)
        return thd_batch(batch, cu_seqlens.view(-1), padded, max_seqlen.view(-1), *args, **kwargs)

    forward = DotProductAttention.forward

    def per_sequence(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                     packed_seq_params=None):
        if packed_seq_params is None:
            return forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias)
        assert packed_seq_params.qkv_format == "thd" and self.attn_mask_type == AttnMaskType.causal
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        # [t, heads, dim] per sequence as [s, b=1, heads, dim]; each output [s, 1, hidden], joined as THD [t, 1, hidden]
        return torch.cat([forward(self, query[a:b, None], key[a:b, None], value[a:b, None], None, attn_mask_type,
                                  attention_bias) for a, b in zip(bounds, bounds[1:]) if b > a])

    core_utils.get_thd_batch_on_this_cp_rank = flat_thd_batch
    DotProductAttention.forward = per_sequence


if __name__ == "__main__":
    # scripts/megatron_lm_cpu.py's own start, with the THD pieces installed once the CPU shim is
    spec = importlib.util.spec_from_file_location("megatron_lm_cpu", CPU_SCRIPT)
    cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu)
    sys.path.insert(0, os.getcwd())
    sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
    cpu.answer_cuda_on_cpu()
    install()
    runpy.run_path("pretrain_gpt.py", run_name="__main__")
