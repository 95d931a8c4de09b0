"""Bridge settings that cannot work with megatron-dhp, beside Megatron-LM's table (`megatron.refusals.REFUSALS`).

Each is a `Refusal` of the same table form, read from `args.bridge_args`'s Namespace and checked by the same
`megatron.refusals.refusals`; the docs list is `BRIDGE_REFUSALS` and the Megatron-LM table together.
"""

from __future__ import annotations

from megatron_dhp.megatron.refusals import Refusal

BRIDGE_REFUSALS: tuple[Refusal, ...] = (
    Refusal("Bridge's dynamic context parallelism (`model.dynamic_context_parallel`)",
            lambda a, c: a.dynamic_context_parallel,
            "model.dynamic_context_parallel with dhp",
            "both form dynamic CP groups",
            "set `model.dynamic_context_parallel = False`"),
    Refusal("decentralized process groups (`dist.use_decentralized_pg`)",
            lambda a, c: a.use_decentralized_pg,
            "dist.use_decentralized_pg with dhp",
            "megatron-dhp's domain is megatron-core's global data-parallel group, which Bridge does not build then",
            "set `dist.use_decentralized_pg = False`"),
    Refusal("an evaluation CP size (`dist.eval_context_parallel_size`)",
            lambda a, c: a.eval_context_parallel_size,
            "dist.eval_context_parallel_size {value} with dhp",
            "Bridge rebinds fixed CP groups for evaluation, and megatron-dhp plans evaluation steps over dynamic groups "
            "itself",
            "set `dist.eval_context_parallel_size = None`"),
    Refusal("`dataset.dataloader_type = \"batch\"`",
            lambda a, c: a.dataloader_type == "batch" and a.dataloader_type,
            "dataset.dataloader_type {value} with dhp",
            "Bridge's finetuning path reads the step's microbatches before the schedule runs, and megatron-dhp's "
            "schedule reads them itself to plan the step",
            "use `dataloader_type = \"single\"` (or `\"cyclic\"`)"),
)

