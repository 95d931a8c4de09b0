"""A Llama-class pretraining recipe of megatron-bridge, scaled down, trained with megatron-dhp.

The model is Bridge's own Llama provider (`AutoBridge.from_hf_config` of a `LlamaConfig`: RMSNorm, SwiGLU, RoPE,
grouped-query attention, untied embeddings) at a small size; the rest is Bridge's pretraining recipe base
(`recipes.common._pretrain_common`) with mock data, as Bridge's Llama 3.2 1B recipe uses. With `--dhp` the
container gets a `dhp` section (`with_dhp`) and trains through `megatron_dhp.bridge.pretrain`; without it, through
Bridge's own `pretrain`, the baseline. A recipe YAML (`--config-file`, its `dhp:` section included) and Hydra-style
overrides (`dhp.max_tokens_per_rank=8192 train.train_iters=100`) go through Bridge's `process_config_with_overrides`.
Run it with torchrun, one process per GPU:

    torchrun --nproc-per-node 8 scripts/bridge_llama_dhp.py --dhp --max-tokens-per-rank 4096
    torchrun --nproc-per-node 8 scripts/bridge_llama_dhp.py --dhp dhp.max_tokens_per_rank=8192 dhp.planner=static
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_dhp.integration.dhp_config import DhpConfig


def llama_config(*, seq_length: int = 4096, hidden: int = 512, layers: int = 4, heads: int = 8, kv_heads: int = 4,
                 vocab: int = 32000, train_iters: int = 20, global_batch: int = 16, micro_batch: int = 1,
                 tensor_parallel: int = 1, pipeline_parallel: int = 1, lr: float = 3e-4) -> Any:
    """Bridge's pretraining recipe base with a small Llama from Bridge's Llama provider (mock data, no checkpoints,
    per-token loss, which dhp needs and Bridge's loss reporting already uses)."""
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.recipes.common import _pretrain_common
    from transformers import LlamaConfig

    hf = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_length,
                     tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    cfg = _pretrain_common()
    cfg.model = AutoBridge.from_hf_config(hf).to_megatron_provider(load_weights=False)
    cfg.model.seq_length = cfg.dataset.seq_length = seq_length
    cfg.model.tensor_model_parallel_size = tensor_parallel
    cfg.model.pipeline_model_parallel_size = pipeline_parallel
    cfg.model.context_parallel_size = 1  # dhp forms the CP groups itself
    cfg.model.calculate_per_token_loss = True
    cfg.ddp.average_in_collective = False  # megatron-core refuses it with a per-token loss
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_size = vocab
    cfg.dataset.num_workers = 0
    cfg.train.train_iters = train_iters
    cfg.train.global_batch_size = global_batch
    cfg.train.micro_batch_size = micro_batch
    cfg.train.manual_gc = False
    cfg.validation.eval_interval = None
    cfg.validation.eval_iters = 0
    cfg.optimizer.lr = lr
    cfg.scheduler.lr_warmup_iters = 0
    cfg.scheduler.lr_decay_iters = train_iters
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = None
    return cfg


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The recipe's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dhp", action=argparse.BooleanOptionalAction, default=True,
                   help="train with megatron-dhp (default); --no-dhp: Bridge's own pretrain, the baseline")
    p.add_argument("--max-tokens-per-rank", type=int, default=4096, help="DhpConfig.max_tokens_per_rank")
    p.add_argument("--layer-spec", choices=("local", "te"), default="te", help="DhpConfig.layer_spec (te on GPUs)")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--pipeline-parallel", type=int, default=1)
    p.add_argument("--config-file", help="a recipe YAML merged into the container (its dhp: section too)")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides applied last, e.g. dhp.max_tokens_per_rank=8192")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the recipe and train it, with dhp or as Bridge alone."""
    a = parse(argv)
    cfg = llama_config(seq_length=a.seq_length, hidden=a.hidden, layers=a.layers, train_iters=a.train_iters,
                       global_batch=a.global_batch_size, tensor_parallel=a.tensor_parallel,
                       pipeline_parallel=a.pipeline_parallel)
    if a.dhp:
        from megatron_dhp.bridge import with_dhp

        cfg = with_dhp(cfg, DhpConfig(max_tokens_per_rank=a.max_tokens_per_rank, layer_spec=a.layer_spec))
    if a.config_file or a.overrides:
        from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

        cfg = process_config_with_overrides(cfg, config_filepath=a.config_file, cli_overrides=a.overrides)
    if a.dhp:
        from megatron_dhp.bridge import forward_step, pretrain

        pretrain(cfg, forward_step)
    else:
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain

        pretrain(cfg, forward_step)


if __name__ == "__main__":
    main()
