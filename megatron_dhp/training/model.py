"""The model and optimizer a training rank builds: megatron-core as shipped, plus the DHP layer spec.

The GPT is wrapped in megatron's `DistributedDataParallel` over the dynamic domain (static CP 1) with
per-token loss, so gradients are summed and the runtime's normalisation keeps the math exact. The optimizer
is megatron-core's own (`get_megatron_optimizer`, non-distributed; it falls back to torch AdamW where
neither TransformerEngine nor Apex is installed) with its learning-rate scheduler.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_dhp.errors import DhpError
from megatron_dhp.models.gpt import build_tiny_gpt_chunks
from megatron_dhp.models.vlm import TinyVLM
from megatron_dhp.runtime.layer_spec import dhp_layer_spec
from megatron_dhp.training.config import ModelConfig, RunConfig, VisionConfig


def build_model(config: ModelConfig, *, seed: int, layer_spec: str = "local", vision: VisionConfig | None = None,
                virtual: int = 1) -> DistributedDataParallel | list[DistributedDataParallel]:
    """The GPT with dynamic-CP attention, behind a vision tower when `vision` has layers (`models.vlm`);
    weights a function of `seed` only (any rank, TP or PP count). With `virtual` V > 1 the stage's V model
    chunks (interleaved pipelining), each in its own DDP."""
    spec = dhp_layer_spec(backend=layer_spec)
    vlm = vision.model(config) if vision is not None else None
    if vlm is not None and virtual > 1:
        raise DhpError(f"train.vpp = {virtual} with a vision tower: interleaved pipelining runs text models; use 1")
    if vlm is not None:
        inners = [TinyVLM(vlm, language_spec=spec, seed=seed)]
    else:
        inners = build_tiny_gpt_chunks(config, virtual=virtual, spec=spec, seed=seed)
    chunks = []
    for inner in inners:
        if torch.cuda.is_available():
            inner.cuda()
        chunks.append(DistributedDataParallel(
            config=inner.config,
            ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
            module=inner,
        ))
    return chunks if virtual > 1 else chunks[0]


def build_optimizer(model: DistributedDataParallel | list[DistributedDataParallel],
                    run: RunConfig) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """megatron-core Adam (decoupled weight decay) and a warm-up + cosine learning-rate schedule."""
    if run.clip_grad and not torch.cuda.is_available():
        raise DhpError(f"train.clip_grad = {run.clip_grad}: megatron-core's gradient clipping needs CUDA "
                       "tensors; set train.clip_grad: 0 on CPU")
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, min_lr=run.min_lr, weight_decay=run.weight_decay,
                        clip_grad=run.clip_grad, use_distributed_optimizer=False, bf16=False, fp16=False),
        model if isinstance(model, list) else [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=run.lr, min_lr=run.min_lr, lr_warmup_steps=run.warmup_steps,
        lr_decay_steps=run.steps, lr_decay_style="cosine", start_wd=run.weight_decay, end_wd=run.weight_decay,
        wd_incr_steps=run.steps, wd_incr_style="constant", override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
    return optimizer, scheduler


SCHEDULE_KEYS = {"max_lr": "train.lr", "min_lr": "train.min_lr", "lr_warmup_steps": "train.warmup_steps",
                 "lr_decay_steps": "train.steps", "start_wd": "train.weight_decay"}
"""The schedule's values in a checkpoint (megatron-core's names) and the config keys that set them."""
GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
"""What each optimizer parameter group carries of the schedule (and a checkpoint would bring back)."""


def load_optimizer_state(optimizer: MegatronOptimizer, scheduler: OptimizerParamScheduler, optimizer_state: dict,
                         scheduler_state: dict) -> list[str]:
    """Load a checkpoint's optimizer and schedule state but keep this run's schedule (the `SCHEDULE_KEYS`): by
    default megatron-core takes the checkpoint's, so a resumed run would silently ignore a lowered train.lr.
    Returns a note naming each key whose value changed."""
    ours = scheduler.state_dict()
    groups = [{k: group[k] for k in GROUP_KEYS if k in group} for group in optimizer.param_groups]
    optimizer.load_state_dict(optimizer_state)
    for group, kept in zip(optimizer.param_groups, groups):
        group.update(kept)
    scheduler.load_state_dict(scheduler_state)  # the steps taken; the values are ours (override_opt_param_scheduler)
    changed = [f"{key} {scheduler_state[name]:g} -> {ours[name]:g}" for name, key in SCHEDULE_KEYS.items()
               if scheduler_state.get(name) != ours[name]]
    if not changed:
        return []
    return [f"resumed on this config's schedule, not the checkpoint's: {', '.join(changed)}"]
