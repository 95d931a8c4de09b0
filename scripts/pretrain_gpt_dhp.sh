#!/usr/bin/env bash
# Pretrain a Llama-3-8B-like GPT with megatron-dhp on NNODES nodes x 8 GPUs (NCCL).
#
# Every training step megatron-dhp splits each TP coordinate's data-parallel ranks into context-parallel
# groups of any size, sized to that step's documents; TP stays 2 and the static CP size stays 1.
#
# --seq-length is the longest context a row may hold (SEQ_LENGTH, 128K here); max_tokens_per_rank in the YAML
# is what one GPU holds (M, 16K). dhp gains only where the first is larger: a row's documents longer than M get
# a group of ranks, the short ones one rank each. The domain (NNODES x 8 / TP ranks) must hold a whole row:
# 128K rows at M 16K need 8 ranks, so NNODES >= 2 (docs/megatron-lm.md#choosing---seq-length-and-m).
#
# Once:  pip install -e /path/to/megatron-dhp               (or put it on PYTHONPATH)
#        scripts/apply_patches.sh /path/to/Megatron-LM      (any core_v0.16.1 .. main, dev checkout), or
#        DHP_HOOKS=import: leave the checkout unpatched, the launcher hooks it in memory
# Then on every node (same command, its own NODE_RANK):
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 MEGATRON_LM=/path/to/Megatron-LM \
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=meta-llama/Meta-Llama-3-8B \
#   CHECKPOINT_DIR=/checkpoints/llama3-8b-dhp scripts/pretrain_gpt_dhp.sh [more Megatron flags]
# DRY_RUN=1 prints the torchrun command instead of running it.
set -euo pipefail

DHP_ROOT=$(cd "$(dirname "$0")/.." && pwd)
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (hooked by scripts/apply_patches.sh, or DHP_HOOKS=import)}"
: "${DATA_PATH:?set DATA_PATH to a Megatron .bin/.idx prefix}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a Hugging Face tokenizer name or path}"
: "${CHECKPOINT_DIR:?set CHECKPOINT_DIR for checkpoints and logs}"
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
GPUS_PER_NODE=8
SEQ_LENGTH=${SEQ_LENGTH:-131072}

# NCCL and CUDA. Megatron overlaps TP communication assuming one hardware queue per device.
export CUDA_DEVICE_MAX_CONNECTIONS=1
# Fail fast instead of hanging when a rank dies.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# Cluster-specific; uncomment and adapt (InfiniBand HCAs, the interface for bootstrap traffic):
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3
# export NCCL_SOCKET_IFNAME=eth0
# megatron-dhp creates its group family at start-up (at most max_groups_per_rank communicators per rank,
# logged with their estimated memory); NCCL children split from a parent share its buffers with this set
# before the first communicator (torch splits new groups from a default group bound to a device).
export NCCL_COMM_SPLIT_SHARE_RESOURCES="${NCCL_COMM_SPLIT_SHARE_RESOURCES:-1}"
# NVLink SHARP buffers come with every communicator of 3+ ranks in an NVSwitch node (hundreds of MiB each,
# and megatron-dhp's group family holds up to max_groups_per_rank communicators): off unless you turn it on.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
# TransformerEngine's p2p context parallelism (layer_spec te) batches each ring step's send and receive, so
# torch keeps them on the group's communicator instead of opening one per pair of ranks.
export NVTE_BATCH_MHA_P2P_COMM="${NVTE_BATCH_MHA_P2P_COMM:-1}"
# Every step has new token counts per rank and microbatch: expandable segments keep the caching allocator
# from fragmenting under those varying shapes.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

DISTRIBUTED_ARGS=(
  --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)

# Llama-3-8B shape: 32 layers, hidden 4096, 32 heads in 8 KV groups, SwiGLU 14336, RoPE (base 500000).
MODEL_ARGS=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
  --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --position-embedding-type rope --rotary-base 500000
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0
  --transformer-impl transformer_engine
)

PARALLEL_ARGS=(
  --tensor-model-parallel-size 2     # fixed for the run: weights never move
  --pipeline-model-parallel-size 1   # PP works too (the domain per stage holds M // PP tokens per rank)
  --context-parallel-size 1          # megatron-dhp forms the CP groups itself, every step
  --cp-comm-type p2p                 # TransformerEngine's CP inside each group (THD: p2p or all_gather)
  --use-distributed-optimizer
  --overlap-grad-reduce
)

TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 32 --train-iters 100000   # 32 rows of 128K: 4M tokens a step
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --bf16
  --calculate-per-token-loss         # required by --dhp: the loss is summed per token over the global batch
)

# Each document is its own sequence (positions restart, no attention across documents): megatron-dhp
# plans documents, so a row of short documents costs what they cost, not what the full row would. The corpus
# needs EOD tokens between documents (tools/preprocess_data.py --append-eod), or every row is one sequence.
# megatron-dhp never reads the loader's attention mask (S x S per row: 64 GiB at 128K), so it is not built.
DATA_ARGS=(
  --data-path "$DATA_PATH" --split 99,1,0
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
  --reset-position-ids --reset-attention-mask --eod-mask-loss
  --no-create-attention-mask-in-dataloader
)

DHP_ARGS=(
  --dhp --dhp-config "$DHP_ROOT/configs/llama3_8b_dhp.yaml"
  # --dhp-cost my_cluster.yaml       # a cost model fitted by megatron-dhp profile
)

OUTPUT_ARGS=(
  --log-interval 10 --log-throughput
  --save-interval 1000 --eval-interval 1000 --eval-iters 10
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --tensorboard-dir "$CHECKPOINT_DIR/tensorboard"
)

# DHP_HOOKS=import: python -m megatron_dhp.megatron.run makes the hooks in memory as Megatron-LM imports
if [[ "${DHP_HOOKS:-}" == import ]]; then ENTRY=(-m megatron_dhp.megatron.run pretrain_gpt.py); else ENTRY=(pretrain_gpt.py); fi
COMMAND=(
  torchrun "${DISTRIBUTED_ARGS[@]}" "${ENTRY[@]}"
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${DHP_ARGS[@]}"
  "${OUTPUT_ARGS[@]}" "$@"
)
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${COMMAND[@]}"
  echo
  exit 0
fi
cd "$MEGATRON_LM"
exec "${COMMAND[@]}"
