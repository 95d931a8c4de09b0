"""What the host-sync test runs on every spawned gloo rank: each variant's layer under `NoHostSync`."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from megatron_dhp.runtime.attention import flex
from megatron_dhp.runtime.attention.comm import PeerRing
from megatron_dhp.runtime.attention.context import CPContext
from megatron_dhp.runtime.attention.core_attention import dynamic_cp_attention
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.testing.host_sync import HostSyncError, NoHostSync, OpCount, opaque
from tests.ranks import start_gloo_rank

COMMS = ("allgather", "ring", "ulysses", "p2p")


def _layer(ctx: CPContext, heads: int, kv_heads: int, dim: int, backward: bool) -> None:
    t = ctx.layout.num_slots
    q, k, v = (torch.randn(t, n, dim, requires_grad=backward) for n in (heads, kv_heads, kv_heads))
    out = dynamic_cp_attention(q, k, v, ctx, dim ** -0.5)
    if backward:
        out.backward(torch.ones_like(out))


def layers_without_host_sync(lengths: tuple[int, ...], many: tuple[int, ...]) -> dict:
    """Per (group size, comm, backend): None, or the first host-syncing operation of two layers' forward and
    backward (the CPU's `auto`) or forward (`flex`); and per (group size, comm): the operators one flex layer
    issues on `lengths[:1]`-sized one sample and on `many` samples of the same total."""
    flex._flex_call = opaque(flex._flex_call)  # torch compiles flex's eager path, which no mode may watch
    start_gloo_rank()
    groups = {d: dist.new_group(list(range(d))) for d in (2, 3, 4)}
    rank, out = dist.get_rank(), {}
    for d in (1, 2, 3, 4):
        if rank >= d:
            continue
        for comm in COMMS if d > 1 else ("allgather",):
            group = None if d == 1 else PeerRing(tuple(range(d)), rank, None) if comm == "p2p" else groups[d]

            def ctx(sample_lengths, backend, group=group, comm=comm, d=d):
                layout = MicrobatchLayout(tuple(range(len(sample_lengths))), sample_lengths, d, rank)
                return CPContext(layout, group, comm, backend)  # built outside the layer: once per microbatch

            for backend, backward in (("auto", True), ("flex", False)):
                c = ctx(lengths, backend)
                try:
                    with torch.set_grad_enabled(backward), NoHostSync():
                        for _ in range(2):
                            _layer(c, 4, 2, 16, backward)
                    out[d, comm, backend] = None
                except HostSyncError as e:
                    out[d, comm, backend] = str(e)
            counts = []
            for sample_lengths in ((sum(many),), many):
                c = ctx(sample_lengths, "flex")
                with torch.no_grad():
                    _layer(c, 4, 2, 16, False)  # the first layer builds the microbatch's block masks
                    with OpCount() as ops:
                        _layer(c, 4, 2, 16, False)
                counts.append(ops.total)
            out[d, comm, "ops"] = tuple(counts)
    return out


def model_steps_without_host_sync(seed: int) -> dict[str, str | None]:
    """Per model ("mtp": a GPT with one multi-token-prediction layer, "vlm": the vision-language model): None,
    or the first host-syncing operation of what megatron-dhp runs or changes inside a step's models: the
    language model's transformer layers (dynamic-CP attention, RoPE), the MTP block and its token rolls, the
    merge of image rows into the embeddings, and the whole backward; on a random plan of the 3 ranks' domain,
    checked exact against one process. Outside the watch: megatron-core's own vision tower and cross-entropy,
    which megatron-dhp leaves as they are (a static run pays the same), and the step's bookkeeping."""
    from megatron_dhp.cost.config import Domain
    from megatron_dhp.models.gpt import TinyGPTConfig
    from megatron_dhp.models.vlm import TinyVLM, TinyVLMConfig, random_vlm_samples
    from megatron_dhp.runtime import mtp, step
    from megatron_dhp.solver.random_plan import random_plan
    from megatron_dhp.verify.selfcheck import SelfCheck, random_samples
    from megatron_dhp.workload.sample import Batch
    from tests.ranks import start_cpu_rank

    found: list[str] = []

    def watched(fn):
        def call(*args, **kwargs):
            with NoHostSync(found):
                return fn(*args, **kwargs)
        return call

    mtp.roll_left = watched(mtp.roll_left)
    TinyVLM.embed = watched(TinyVLM.embed)
    step._LossSum.backward = watched(step._LossSum.backward)
    start_cpu_rank()
    rng, out = random.Random(seed), {}
    for kind in ("mtp", "vlm"):
        language = TinyGPTConfig(mtp_num_layers=1 if kind == "mtp" else 0)
        vlm = TinyVLMConfig(language=language) if kind == "vlm" else None
        check = SelfCheck(config=language, seed=seed, vlm=vlm)
        model = check.chunks[0].module
        gpt = model.language if vlm is not None else model
        for block in (gpt.decoder, getattr(gpt, "mtp", None)):
            if block is not None:
                block.forward = watched(block.forward)
        batch = Batch.from_lengths([rng.randint(1, 48) for _ in range(6)])
        plan = random_plan(batch, Domain(world_size=check.domain.size, gpus_per_node=check.domain.size,
                                         max_tokens_per_rank=48), rng)
        samples = (random_vlm_samples(batch, vlm, seed=seed) if vlm is not None
                   else random_samples(batch, vocab_size=language.vocab_size, seed=seed))
        found.clear()
        result = check.check(plan, samples, "ring")
        out[kind] = found[0] if found else None if result.ok else f"not exact: {result}"
    return out
