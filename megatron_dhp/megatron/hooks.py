"""The entries a Megatron-LM run calls: the layer spec at model build, `setup` once the data exists.

Everything else megatron-dhp needs in a run hangs off these; the patches in patches/ only call them.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import logging
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dhp.errors import DhpError
from megatron_dhp.integration.job_spec import JobSpec
from megatron_dhp.integration.step_runtime import build_step_runtime
from megatron_dhp.megatron.arguments import dhp_config_from_args, exits_on_dhp_error
from megatron_dhp.megatron.data import (
    DocumentCheck,
    IteratorShape,
    step_iterator,
    validation_sets,
    wrap_data_iterator,
)
from megatron_dhp.megatron.metrics import StepLog, Writers
from megatron_dhp.megatron.model_flags import model_memory, model_shape
from megatron_dhp.megatron.state import DhpRuntime
from megatron_dhp.runtime.attention.kernels import describe
from megatron_dhp.runtime.domain import DynamicDomain, host_groups
from megatron_dhp.runtime.layer_spec import with_dynamic_cp
from megatron_dhp.runtime.pipeline import check_pipeline

logger = logging.getLogger(__name__)


@exits_on_dhp_error()
def layer_spec(spec: ModuleSpec, args: argparse.Namespace) -> ModuleSpec:
    """The transformer layer spec Megatron chose, with attention and RoPE over each microbatch's group (a
    `DhpError`: one line on rank 0, exit 2 on every rank)."""
    return with_dynamic_cp(spec, backend=dhp_config_from_args(args).layer_spec)


def layer_spec_provider(spec: ModuleSpec | Callable | None, args: argparse.Namespace) -> Callable:
    """`layer_spec` for megatron-core >= 0.19, where `GPTModelConfig.transformer_layer_spec` is resolved late.

    The returned callable resolves Megatron's own choice (the default spec when `spec` is None) first.
    """

    def provide(config: object, vp_stage: int | None = None) -> ModuleSpec:
        if spec is None:
            from megatron.training.models.gpt import default_layer_spec

            base = default_layer_spec(config, vp_stage)
        elif isinstance(spec, ModuleSpec):
            base = spec
        else:
            base = spec(config, vp_stage=vp_stage) if "vp_stage" in inspect.signature(spec).parameters else spec(config)
        return layer_spec(base, args)

    return provide


@exits_on_dhp_error()
def setup(args: argparse.Namespace, train_data_iterator: object, valid_data_iterator: object,
          test_data_iterator: object, *, writers: Writers | None = None) -> tuple[object, object, object]:
    """Start megatron-dhp and return Megatron's three data iterators as iterators of planned steps.

    Call on every rank once the model and Megatron's data iterators exist. Collective. The iterators carry
    this rank's `DhpRuntime` to the schedule, so Megatron must hand the schedule these iterators. A `DhpError`
    (e.g. a --seq-length the domain cannot hold) is one line on rank 0 and exit 2 on every rank, as a refusal.
    The training iterator writes dhp's scalars through `writers` (default: Megatron-LM's own, `Writers`), numbered
    by Megatron's iterations from `args.iteration` on (`_log_steps`).
    """
    config = dhp_config_from_args(args)
    # Megatron's parallel state is initialised: the domain is its DP x CP group (one world all-gather).
    domain = DynamicDomain.from_parallel_state(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if stages > 1:
        check_pipeline(domain)
    spec = JobSpec.for_domain(
        config, domain, world_size=dist.get_world_size(), tensor_parallel=args.tensor_model_parallel_size,
        sequence_parallel=bool(args.sequence_parallel), pipeline_stages=stages, virtual_stages=virtual,
        expert_parallel=parallel_state.get_expert_model_parallel_world_size(),
        moe_dispatcher=getattr(args, "moe_token_dispatcher_type", None),
        fully_sharded=bool(getattr(args, "use_torch_fsdp2", False)), model=model_memory(args, stages),
        shape=model_shape(args))
    cap = _sample_cap(args.seq_length, spec)
    if dist.get_rank() == 0:
        warn_if_rows_fit_one_rank(args.seq_length, spec)
    share_group, share_source = _loader_sharing(domain)
    runtime = DhpRuntime(
        steps=build_step_runtime(spec, domain, dataset_max_tokens=cap or args.seq_length),
        share_group=share_group,
        share_source=share_source,
        split_documents=bool(args.reset_attention_mask),
        max_sample_tokens=cap,
    )
    # The nesting of each split's iterators comes from the arguments: a list is model chunks or validation sets.
    shape = IteratorShape.of(args)
    sets = validation_sets(valid_data_iterator, runtime) if getattr(args, "multiple_validation_sets", False) else 0
    # Only training reads ahead to plan the next step in the background; evaluation plans when it runs.
    wrapped = (
        wrap_data_iterator(train_data_iterator, runtime, lookahead=config.overlap_planning, shape=shape),
        wrap_data_iterator(valid_data_iterator, runtime, lookahead=False, shape=IteratorShape.of(args, sets=sets)),
        wrap_data_iterator(test_data_iterator, runtime, lookahead=False, shape=shape),
    )
    # At exit our iterators let go of Megatron's loaders before multiprocessing joins their workers: a worker
    # forked after --exit-signal-handler took SIGTERM ignores the terminate() that join waits on, so a loader
    # still held hung the exit (torchrun killed the ranks 20 s later); let go, each shuts its workers down.
    atexit.register(lambda: [step_iterator(it).close() for it in _flat(wrapped)])
    _log_steps(args, runtime, wrapped, Writers.of_megatron_lm() if writers is None else writers)
    return wrapped


def _log_steps(args: argparse.Namespace, runtime: DhpRuntime, wrapped: tuple, writers: Writers) -> None:
    """Megatron's logging cadence on the wrapped iterators (`megatron.metrics.StepLog`): training's plan line every
    --log-interval and its scalars every --tensorboard-log-interval of Megatron's iterations, counted from
    `args.iteration`; evaluation's plan line every --log-interval of its own steps, and no scalars. The attention
    backend goes to the writers once, as text."""
    config, prints = runtime.steps.config, dist.get_rank() == 0
    train = StepLog(config.log_plans, prints, args.log_interval, args.tensorboard_log_interval, args.iteration,
                    writers)
    for it in _flat(wrapped[0]):
        step_iterator(it).log = train
    # rank 0 reads its model-parallel group's loader; packed SFT rows mark their conversations with cu_seqlens
    if prints and wrapped[0] is not None and not getattr(args, "sft", False):
        step_iterator(_flat(wrapped[0])[0]).documents = DocumentCheck(runtime.split_documents)
    for it in _flat(wrapped[1:]):
        step_iterator(it).log = StepLog(config.log_plans, prints, args.log_interval)
    backend = describe(config.attention_backend, runtime.steps.domain.device)
    writers.text("dhp/attention-backend", f"layer_spec {config.layer_spec}: {backend}; {runtime.steps.kernels}",
                 args.iteration)


def warn_if_rows_fit_one_rank(seq_length: int, spec: JobSpec) -> None:
    """One warning where no row is longer than a rank holds: every sequence then fits one rank, and dhp plans what
    static data parallelism does."""
    if seq_length <= spec.caps.microbatch:
        logger.warning("megatron-dhp: --seq-length %d is no longer than the %d tokens a rank holds in a microbatch, so "
                       "every sequence fits one rank and dhp plans what static data parallelism does; set --seq-length "
                       "to the longest context to train (docs/megatron-lm.md, 'Choosing --seq-length and M')",
                       seq_length, spec.caps.microbatch)


def _flat(iterators: object) -> list:
    """The wrapped iterators, lists (per validation set, per virtual pipeline stage) flattened, None left out."""
    if isinstance(iterators, (list, tuple)):
        return [x for it in iterators for x in _flat(it)]
    return [] if iterators is None else [iterators]


def _loader_sharing(domain: DynamicDomain) -> tuple[dist.ProcessGroup | None, int]:
    """The model-parallel group (None when it is this rank alone; its gloo twin when the domain has a host
    control plane, since the shared samples are read on the host) and the global rank in it that reads the
    loader, tensor-parallel rank 0 of the first pipeline stage. Collective over the world."""
    group = parallel_state.get_model_parallel_group()
    if group.size() == 1:
        return None, dist.get_rank()
    coordinates: list[tuple[int, int] | None] = [None] * group.size()
    me = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    dist.all_gather_object(coordinates, me, group=group)
    ranks = tuple(dist.get_process_group_ranks(group))
    source = ranks[coordinates.index((0, 0))]
    if domain.control is not None:
        every: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, ranks)
        group = host_groups(sorted(set(every)), domain.timeout)[ranks]
    return group, source


def _sample_cap(seq_length: int, spec: JobSpec) -> int | None:
    """Where to cut sequences: nowhere if the domain holds the longest one (`JobSpec.caps.longest_sample`), there
    with `truncate`; else a `DhpError` naming the max_tokens_per_rank that would hold it."""
    caps, kv = spec.caps, spec.kv_memory_per_token
    if seq_length <= caps.longest_sample:
        return None
    if spec.config.truncate:
        return caps.longest_sample
    stages, virtual = spec.pipeline_stages, spec.virtual_stages
    at = "" if stages == 1 else f" // {stages} pipeline stages" if virtual == 1 else \
        f" at {stages} pipeline stages of {virtual} chunks"
    kept = f", its keys and values on every rank at kv_memory_per_token {kv:.3g}" if kv else ""
    raise DhpError(
        f"--seq-length {seq_length} exceeds what the domain of {spec.domain_size} ranks holds at max_tokens_per_rank "
        f"{caps.planner}{at} ({caps.longest_sample} tokens{kept}); raise --dhp-max-tokens-per-rank to at least "
        f"{spec.stated_cap_for(seq_length)} or set truncate: true"
    )
