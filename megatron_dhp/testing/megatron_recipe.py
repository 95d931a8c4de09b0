"""The CPU recipe's pretrain_gpt.py flags (docs/megatron-lm.md): a tiny GPT on mock data over gloo ranks, as
the upstream tests and bench/megatron_straggler.py run it (with scripts/megatron_lm_cpu.py)."""

from __future__ import annotations


def tiny_gpt_flags(*, seq_length: int = 64, global_batch: int = 8, iters: int = 3, eval_interval: int = 2) -> list[str]:
    """Megatron-LM flags of the tiny GPT (2 layers of 64, 4 heads in 2 groups, RoPE, SwiGLU), local
    implementation, no fusions, per-token loss, mock data; micro-batches of 2 rows of `seq_length` tokens."""
    return f"""
        --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention
        --num-query-groups 2 --seq-length {seq_length} --max-position-embeddings {seq_length} --position-embedding-type rope
        --normalization RMSNorm --swiglu --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
        --transformer-impl local --no-rope-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion
        --no-masked-softmax-fusion --no-gradient-accumulation-fusion --no-persist-layer-norm
        --context-parallel-size 1 --distributed-backend gloo
        --micro-batch-size 2 --global-batch-size {global_batch} --train-iters {iters} --lr 1e-3 --clip-grad 0.0
        --calculate-per-token-loss --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --split 98,1,1
        --eod-mask-loss --log-interval 1 --eval-interval {eval_interval} --eval-iters 1
    """.split()
