"""One GPU check: every CUDA path against its reference, and the attention's speed, written to one JSON report.

Sections, each timed, each check ok / fail (with its error and tolerance) / skipped (with why):

1. attention (first: the most valuable; it also builds the `csrc` kernels it uses, timed as its first check):
   - exactness: the `varlen`, `sdpa`, `flash` (if flash-attn is installed) and `flex` kernels of
     `runtime.attention.kernels` on virtual groups of 1, 2 and 4 ranks (`testing.virtual_group`) under each
     comm (allgather, ulysses, ring) against the `math` kernel in fp32 on one rank: forward and dq, dk, dv, bf16,
     GQA (8 query / 2 KV heads of 128), a long-tailed packed microbatch of 3000 tokens; MLA's head shapes for
     the non-compiled kernels, fp16 too in a full run; TransformerEngine's core attention where installed;
   - one rank: what `dynamic_cp_attention` runs for a group of one (`varlen`'s `causal` on the microbatch's
     `AttentionMeta`), forward + backward, against one call of torch's `varlen_attn` on the same samples
     (32 query / 8 KV heads of 128, long-tailed, 32K tokens, and 128K in a full run): ours / torch <= 1.10;
     flex timed the same way (recorded);
   - ring: 2, 4 and 8 virtual ranks' ring blocks, merges and backward on one GPU against the same single
     `varlen_attn`: all ranks / torch <= 1.2.
2. train_step: steps of a ~1B megatron-core GPT (bf16, local layer spec with dynamic-CP attention, 8K-token
   microbatches) on a one-rank NCCL job through megatron-dhp's step engine and planner: tokens/s, MFU, the
   share of the step outside the model's forward/backward (<= 5 %), and host syncs in the model's forward and
   backward (`torch.cuda.set_sync_debug_mode("error")`). It stops measuring `--step-limit` seconds after its
   start (one step is always measured); `--skip train_step` leaves it out.
3. kernels: the `csrc` kernels behind `runtime.fused` against the torch fallback on CUDA tensors (copies bit
   for bit, `lse_merge` to float rounding), each path's effective GB/s (compulsory bytes / median time, CUDA
   events) and the kernels' share of the device's peak memory bandwidth.
4. calibration: `megatron-dhp profile`'s timing and fit (`training.profile.profile`, one spawned NCCL rank)
   on a GPT at a few lengths: the fitted coefficients and each point's predicted vs measured time.
5. closed loop: the slot timer's CUDA events against synchronised wall time, and a one-rank train run
   planned with a cost model far off this GPU, whose closed loop must bring the predicted step time
   within 10 % of the measured one on 90 % of the steps after a warm-up.
6. sharding: megatron-core's torch FSDP2 wrapper (`selftest --fsdp`) on a one-rank NCCL job, loss and every
   gradient against one process.
7. safety: multi-token prediction on a one-rank NCCL job (its loss scale on the model's device) against one
   process, and the head-of-line blocking of CUDA_DEVICE_MAX_CONNECTIONS=1 behind the overlapped reduction's
   rule (recorded).

`--cpu-smoke` runs the attention and train_step sections on the CPU with tiny sizes (sdpa in place of varlen,
flex forward only, megatron-dhp's `NoHostSync` in place of the sync debug mode, a tiny GPT on a gloo rank),
timings recorded but not judged: the code paths, tried where there is no GPU. `--only` / `--skip` pick
sections.

Exit status: 0 when every check that ran passed, 1 when one failed, 3 when none ran (no CUDA device: every
section is skipped, so a user or CI sees that nothing was checked). `--quick` runs the attention, train_step
and safety sections with smaller sizes; every section starts no check after its time cap (`SECTION_CAP_S`:
about 6 minutes in all with `--quick`, 10 without), and the report is written after each section, so a run cut
short still reports what it did. A ring's speed bound is `RING_TOLERANCE` times its tile work over one call's
(`ring_tile_ratio`), printed beside the measure.

    python bench/gpu_check.py [--out gpu_check.json] [--quick] [--cpu-smoke] [--only SECTIONS]
                              [--skip SECTIONS] [--step-limit SECONDS]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import inspect
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megatron_dhp.runtime.layout import MicrobatchLayout, padded_length

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NOTHING_CHECKED = 3
NO_CUDA = "no CUDA device"
DEVICE = "cuda"
"""Where the checks put their tensors (a name, so that their logic can be tried on the CPU: `--cpu-smoke`)."""
ROOT = Path(__file__).resolve().parents[1]

PEAK_GB_PER_S: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
)
"""Datasheet memory bandwidth by a substring of `torch.cuda.get_device_name()`, first match wins (so the
specific names come before the family)."""

ATTENTION_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
"""Max |got - fp32 reference|, per unit of the reference's largest magnitude (at least 1): a few roundings
of the half-precision output and of the probabilities a flash kernel feeds its second matmul."""
MERGE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
"""`lse_merge`'s kernel against `merge_partials`, as tests/kernels/test_fused_cuda.py allows."""
FIT_TOLERANCE = 0.15
"""The calibration passes when the median point is predicted within this (the train loop's 15 %)."""


@dataclass
class Check:
    """One comparison or measurement; `error` is measured as `metric` says, against `tolerance`."""

    name: str
    status: str  # "ok", "fail" or "skipped"
    error: float | None = None
    tolerance: float | None = None
    metric: str | None = None
    reason: str | None = None
    numbers: dict = field(default_factory=dict)


@dataclass
class Section:
    """One timed part of the check: its checks and the status they add up to."""

    name: str
    status: str
    seconds: float
    reason: str | None = None
    checks: list[Check] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    """How the sections run (the command line)."""

    quick: bool = False
    """Smaller sizes, fewer repetitions, bf16 only."""
    smoke: bool = False
    """On the CPU with tiny sizes, timings recorded but not judged (`--cpu-smoke`)."""
    step_limit_s: float = 240.0
    """The train_step section stops measuring steps after this many seconds (it always measures one)."""


def compared(name: str, error: float, tolerance: float, metric: str, **numbers: object) -> Check:
    """ok when `error` is a number within `tolerance` (NaN fails)."""
    status = "ok" if error <= tolerance else "fail"
    return Check(name, status, error=error, tolerance=tolerance, metric=metric, numbers=dict(numbers))


def section_status(checks: list[Check]) -> str:
    """fail if any check failed, ok if any passed, skipped if none ran."""
    statuses = {c.status for c in checks}
    return "fail" if "fail" in statuses else "ok" if "ok" in statuses else "skipped"


def skip_reason(checks: list[Check]) -> str | None:
    """The distinct reasons of a section's skipped checks, in order."""
    reasons = dict.fromkeys(c.reason for c in checks if c.status == "skipped" and c.reason)
    return "; ".join(reasons) or None


def exit_code(sections: list[Section]) -> int:
    """1 if a check failed, 3 if nothing ran (every section skipped), else 0."""
    statuses = {s.status for s in sections}
    if "fail" in statuses:
        return EXIT_FAILED
    return EXIT_OK if "ok" in statuses else EXIT_NOTHING_CHECKED


def peak_gb_per_s(device_name: str) -> float | None:
    """The datasheet bandwidth of a device by name, or None when it is not in `PEAK_GB_PER_S`."""
    return next((peak for key, peak in PEAK_GB_PER_S if key in device_name), None)


def gb_per_s(bytes_moved: int, seconds: float) -> float:
    """Effective bandwidth in GB/s (10^9 bytes)."""
    return bytes_moved / seconds / 1e9


def copy_bytes(rows_read: int, rows_written: int, row_bytes: int, index_entries: int = 0) -> int:
    """Compulsory bytes of a row copy: every row read once and written once, plus an int64 index."""
    return (rows_read + rows_written) * row_bytes + 8 * index_entries


def merge_bytes(blocks: int, tokens: int, heads: int, head_dim: int, element_bytes: int) -> int:
    """Compulsory bytes of `lse_merge`: every block's output and fp32 log-sum-exp read, the merge written."""
    return (blocks + 1) * tokens * heads * head_dim * element_bytes + blocks * tokens * heads * 4


def build_report(sections: list[Section], *, device: str | None, quick: bool, total_seconds: float) -> dict:
    """The JSON report: where it ran, every section, the total time and the exit code it implies."""
    code = exit_code(sections)
    return {
        "device": device,
        "peak_gb_per_s": peak_gb_per_s(device) if device else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quick": quick,
        "status": {EXIT_OK: "ok", EXIT_FAILED: "fail", EXIT_NOTHING_CHECKED: "nothing checked"}[code],
        "exit_code": code,
        "total_seconds": total_seconds,
        "sections": finite([asdict(s) for s in sections]),
    }


def finite(obj: object) -> object:
    """`obj` with every NaN or infinity written as a string, so that the report is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def guarded(name: str, fn: Callable[..., list[Check]], *args: object) -> list[Check]:
    """`fn(*args)`, or one failed check carrying the exception when it raises (one broken path fails alone);
    skipped once the running section is past its time cap (`SECTION_CAP_S`), so a slow path cannot take the
    run's budget and the report still comes back."""
    if time.perf_counter() > _deadline[0]:
        return [Check(name, "skipped", reason=f"not started: the section passed its time cap of {_deadline[1]:.0f} s")]
    try:
        return fn(*args)
    except Exception as e:
        last = traceback.extract_tb(e.__traceback__)[-1]
        return [Check(name, "fail", reason=f"{type(e).__name__}: {e} ({Path(last.filename).name}:{last.lineno})")]


# ---------------------------------------------------------------------------------------------- attention

EXACT_BACKENDS = ("varlen", "sdpa", "flash", "flex")
"""The local kernels checked against the oracle (`kernels.kernel`), in the order they run: the one a GPU runs in
bf16 first, flex last (its Triton compilation is the slow part of the section)."""
COMMS = ("allgather", "ulysses", "ring")
GROUP_SIZES = (1, 2, 4)
HEAD_SHAPES = ((128, 128, ""), (192, 128, " mla"))
"""(query/key head size, value head size, name suffix) of the exactness checks: the usual heads, and MLA's
(Q/K 128 + a 64-wide RoPE part, V 128) for the kernels that are not compiled per shape."""
EXACT_BUDGET_S = {False: 300.0, True: 150.0}
"""Seconds (by --quick) the exactness checks may take; a case not started by then is skipped, so that a slow
compilation cannot eat the run's budget."""
TILE = 128
"""Rows of a flash-attention tile, queries and keys alike: a causal block costs the tiles it touches."""
PERF_TOLERANCE = 1.10
"""One rank: megatron-dhp's varlen attention may take this many times torch's own `varlen_attn`."""
RING_TOLERANCE = 1.20
"""A virtual ring of d ranks (every rank's blocks, merges and backward on one GPU) against one `varlen_attn`,
times the ratio of their tile work (`ring_tile_ratio`): zigzag chunks of short samples fill few of a tile's
128 rows, so a ring does more tile work than one call before any overhead."""


def tiles(rows: int, cols: int, causal: bool) -> int:
    """Flash-attention tiles of `TILE` x `TILE` one block of `rows` queries over `cols` keys touches (causal:
    the key tiles at or before each query tile's last row, the block's keys ending with its queries)."""
    q, k = -(-rows // TILE), -(-cols // TILE)
    if not causal:
        return q * k
    return sum(min(k, -(-(cols - rows + min(rows, (i + 1) * TILE)) // TILE)) for i in range(q))


def ring_tile_ratio(lengths: tuple[int, ...], size: int) -> float:
    """The tile work of a zigzag ring of `size` ranks over the samples (every rank's steps: its own shard
    causally, earlier ranks' front chunks in full, its back chunk over later ranks' shards in full) over one
    causal call's on the whole samples. Padded as the layout pads: to 2 x size chunks."""
    if size == 1:
        return 1.0
    ring = whole = 0
    for n in lengths:
        c = -(-n // (2 * size))  # a chunk; a shard is two
        whole += tiles(n, n, True)
        for r in range(size):
            ring += tiles(2 * c, 2 * c, True) + r * tiles(2 * c, c, False) + (size - 1 - r) * tiles(c, 2 * c, False)
    return ring / whole


@dataclass(frozen=True)
class Shape:
    """Sizes of the attention checks: exactness (a few thousand tokens) and timing (tens of thousands)."""

    exact_tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    perf_tokens: tuple[int, ...]
    perf_heads: int
    perf_kv_heads: int
    ring_sizes: tuple[int, ...]
    reps: int
    warmup: int = 3
    calls: int = 3
    """Back-to-back calls per timed repetition up to 32K tokens (one above)."""

    def inner(self, tokens: int) -> int:  # noqa: D102
        return self.calls if tokens <= 32768 else 1


def attention_shape(opts: Options) -> Shape:
    """GPU: 8/2 heads of 128 on 3000 tokens for exactness; 32/8 heads of 128 at 32K (and 128K) tokens for
    timing. CPU smoke: the same code on a few hundred tokens, heads of 32, a couple of timed calls."""
    if opts.smoke:
        return Shape(128, 4, 2, 32, (512,), 4, 2, (2, 4), reps=2, warmup=1, calls=1)
    return Shape(3000, 8, 2, 128, (32768,) if opts.quick else (32768, 131072), 32, 8, (2, 4, 8),
                 5 if opts.quick else 10)


def long_tailed(total: int, longest: int, seed: int = 0) -> tuple[int, ...]:
    """Sample lengths summing to `total`, shuffled: one of `longest` tokens, one of half and one of a quarter
    of it (plus 1 and 3: odd lengths pad to whole zigzag chunks), a single token, then Pareto-tailed draws
    (64 x Pareto(1.2): a median of about 110 tokens, at most a quarter of `longest`) until `total` is reached."""
    rng = random.Random(seed)
    lengths = [longest, longest // 2 + 1, longest // 4 + 3, 1]
    assert sum(lengths) <= total, f"{total} tokens cannot hold a {longest}-token sample and its tail"
    rest = total - sum(lengths)
    while rest > 0:
        n = min(rest, max(1, int(64 * rng.paretovariate(1.2))), max(1, longest // 4))
        lengths.append(n)
        rest -= n
    rng.shuffle(lengths)
    return tuple(lengths)


def tokens_label(tokens: int) -> str:
    """32768 -> '32K', 512 -> '512'."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def causal_pairs(lengths: tuple[int, ...]) -> int:
    """(query, key) pairs causal attention computes over these samples."""
    return sum(n * (n + 1) // 2 for n in lengths)


def attention_flops(lengths: tuple[int, ...], heads: int, head_dim: int) -> int:
    """Forward + backward FLOPs of causal attention (2 matmuls forward, 4 backward, 2 FLOPs a multiply-add)."""
    return 12 * causal_pairs(lengths) * heads * head_dim


def attention_checks(opts: Options) -> list[Check]:
    """Exactness of every kernel and comm variant against the fp32 oracle, then timing against torch's own
    varlen attention (one rank and a virtual ring), in one section."""
    checks = csrc_checks() if DEVICE == "cuda" else []
    shape = attention_shape(opts)
    checks += exactness_checks(opts, shape)
    checks += performance_checks(opts, shape)
    return checks


def csrc_checks() -> list[Check]:
    """Build (or load) the `runtime.fused` kernels before anything uses them, and say how long it took."""
    from megatron_dhp.runtime import fused

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = fused._load_kernels()
    seconds = time.perf_counter() - start
    name = "csrc kernels built or loaded (zigzag copies, lse_merge) for the attention checks"
    if ops is None:
        why = str(caught[0].message) if caught else "not available"
        return [Check(name, "skipped", reason=f"kernels not built, attention takes the torch path: {why}",
                      numbers={"seconds": seconds})]
    return [Check(name, "ok", numbers={"seconds": seconds})]


def _random_inputs(tokens: int, heads: int, kv_heads: int, qk_dim: int, v_dim: int, dtype: torch.dtype,
                   seed: int) -> tuple[torch.Tensor, ...]:
    """q [T, h, qk], k [T, hk, qk], v [T, hk, v] and an output gradient [T, h, v], in `dtype` on `DEVICE`."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return tuple(torch.randn(tokens, n, d, device=DEVICE, generator=gen).to(dtype)
                 for n, d in ((heads, qk_dim), (kv_heads, qk_dim), (kv_heads, v_dim), (heads, v_dim)))


def _exact_cases(opts: Options) -> list[tuple[str, int, str, torch.dtype, tuple[int, int, str]]]:
    """(backend, group size, comm, dtype, head shape) of every exactness case, backend by backend. A group of
    one communicates nothing, so it is one case; MLA's heads and (full runs) fp16 for the non-compiled kernels."""
    layouts = [(1, "allgather")] + [(d, c) for d in GROUP_SIZES if d > 1 for c in COMMS]
    cases = []
    for backend in EXACT_BACKENDS:
        cases += [(backend, d, c, torch.bfloat16, HEAD_SHAPES[0]) for d, c in layouts]
        if backend != "flex":
            cases += [(backend, d, c, torch.bfloat16, HEAD_SHAPES[1]) for d, c in layouts if d <= 2]
            if not opts.quick and not opts.smoke:
                cases += [(backend, d, c, torch.float16, HEAD_SHAPES[0]) for d, c in layouts]
    return cases


def exactness_checks(opts: Options, shape: Shape) -> list[Check]:
    """Every backend x group size x comm on a virtual group (`testing.virtual_group`) against the `math` kernel
    in fp32 on the same (rounded) inputs as one rank: forward, and dq, dk, dv. GQA heads, a long-tailed
    packed microbatch (odd lengths, a single token). A flex case on a CPU is forward only (torch has no CPU
    backward for it)."""
    from megatron_dhp.runtime.attention.kernels import kernel
    from megatron_dhp.testing.virtual_group import virtual_group

    lengths = long_tailed(shape.exact_tokens, shape.exact_tokens // 4)
    budget = EXACT_BUDGET_S[opts.quick]
    start = time.perf_counter()
    oracles: dict = {}
    checks: list[Check] = []
    for backend, size, comm, dtype, (qk_dim, v_dim, suffix) in _exact_cases(opts):
        dims = (qk_dim * shape.head_dim // 128, v_dim * shape.head_dim // 128)
        where = f"d={size}" if size == 1 else f"d={size} {comm}"
        name = f"{backend} {where}{suffix} {str(dtype).removeprefix('torch.')}"
        why_not = kernel(backend).applies(torch.device(DEVICE).type, dtype, dims[0])
        if why_not is None and not opts.smoke and time.perf_counter() - start > budget:
            why_not = f"the exactness checks' budget of {budget:.0f} s is spent"
        if why_not is not None:
            checks.append(Check(name, "skipped", reason=f"{backend}: {why_not}"))
            continue
        key = (dtype, dims)
        if key not in oracles:
            inputs = _random_inputs(sum(lengths), shape.heads, shape.kv_heads, *dims, dtype, seed=len(oracles))
            want = virtual_group(*(x.float() for x in inputs), lengths, 1, "allgather", kernel("math"),
                                 dims[0] ** -0.5)
            oracles[key] = (inputs, want)
        inputs, want = oracles[key]
        backward = not (backend == "flex" and DEVICE == "cpu")
        checks += guarded(name, _compare_exact, name, backend, size, comm, lengths, inputs, want, backward)
    checks += te_checks(shape, lengths)
    return checks


def _compare_exact(name: str, backend: str, size: int, comm: str, lengths: tuple[int, ...], inputs: tuple,
                   want: tuple, backward: bool) -> list[Check]:
    """One case's forward and gradients against the oracle's (out, dq, dk, dv)."""
    from megatron_dhp.runtime.attention.kernels import kernel
    from megatron_dhp.testing.virtual_group import virtual_group

    q, k, v, g = inputs
    scale = q.shape[-1] ** -0.5
    start = time.perf_counter()
    if backward:
        got = virtual_group(q, k, v, g, lengths, size, comm, kernel(backend), scale)
    else:
        with torch.no_grad():
            got = virtual_group(q, k, v, None, lengths, size, comm, kernel(backend), scale)
    seconds = time.perf_counter() - start  # the first case of a kernel includes its compilation
    tol = ATTENTION_TOLERANCE[q.dtype]
    metric = "max |got - fp32 math| / max(1, max |math|)"
    numbers = {"tokens": int(q.shape[0]), "samples": len(lengths), "seconds": seconds}
    checks = [compared(f"{name} forward", _scaled_error(got[0], want[0]), tol, metric, **numbers)]
    if not backward:
        return checks + [Check(f"{name} backward", "skipped", reason=f"{backend} has no backward on {DEVICE}")]
    errors = {grad: _scaled_error(a, b) for grad, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:])}
    return checks + [compared(f"{name} backward", max(errors.values()), tol, metric, **errors, **numbers)]


def _scaled_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| per unit of max(1, max |want|)."""
    diff = (got.float() - want.float()).abs().max().item()
    return diff / max(1.0, want.float().abs().max().item())


def _attention_grads(fn, q, k, v, grad):
    """(out, dq, dk, dv) of `fn(q, k, v)` under an output gradient."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype)))


def te_checks(shape: Shape, lengths: tuple[int, ...]) -> list[Check]:
    """TransformerEngine's core attention of the `te` layer spec on a group of one (a one-rank NCCL job)."""
    name = "te d=1 bfloat16"
    if DEVICE != "cuda" or importlib.util.find_spec("transformer_engine") is None:
        return [Check(name, "skipped", reason="transformer-engine not installed" if DEVICE == "cuda" else
                      "TransformerEngine needs a CUDA device")]
    from megatron_dhp.runtime.attention.kernels import kernel
    from megatron_dhp.testing.virtual_group import virtual_group

    q, k, v, g = _random_inputs(sum(lengths), shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim,
                                torch.bfloat16, seed=7)
    scale = shape.head_dim ** -0.5
    want = virtual_group(q.float(), k.float(), v.float(), g.float(), lengths, 1, "allgather", kernel("math"), scale)

    def compare() -> list[Check]:
        with one_rank_job():
            got = _attention_grads(te_attention(MicrobatchLayout(tuple(range(len(lengths))), lengths, 1, 0), scale),
                                   q, k, v, g)
        tol, metric = ATTENTION_TOLERANCE[q.dtype], "max |got - fp32 math| / max(1, max |math|)"
        return [compared(f"{name} forward", _scaled_error(got[0], want[0]), tol, metric),
                compared(f"{name} backward", max(_scaled_error(a, b) for a, b in zip(got[1:], want[1:])), tol, metric)]

    return guarded(name, compare)


def te_attention(layout: MicrobatchLayout, scale: float) -> Callable:
    """TransformerEngine's core attention of the `te` layer spec on a one-rank group's THD microbatch."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dhp.runtime.attention.context import CPContext, DhpPackedSeqParams
    from megatron_dhp.runtime.layer_spec import dhp_layer_spec

    core = dhp_layer_spec(backend="te").submodules.self_attention.submodules.core_attention
    params = DhpPackedSeqParams.for_microbatch(CPContext(layout, None, device=DEVICE))

    def fn(q, k, v):
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        config = TransformerConfig(
            num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, num_query_groups=kv_heads,
            kv_channels=head_dim, params_dtype=q.dtype, bf16=q.dtype == torch.bfloat16,
            fp16=q.dtype == torch.float16, attention_dropout=0.0, hidden_dropout=0.0,
        )
        module = core(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                      softmax_scale=scale)
        out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        return out.view(q.shape)

    return fn


# attention timing


def judged(name: str, value: float, tolerance: float, metric: str, opts: Options, **numbers: object) -> Check:
    """`compared`, except in the CPU smoke, whose timings are recorded but not judged."""
    if opts.smoke:
        return Check(name, "ok", error=value, tolerance=tolerance, metric=metric,
                     reason="CPU smoke: recorded, not judged", numbers=dict(numbers))
    return compared(name, value, tolerance, metric, **numbers)


def torch_varlen() -> tuple[Callable, str]:
    """torch's own causal varlen attention over packed samples, (call(q, k, v, cu, max_len, scale), how it is
    called): `torch.nn.attention.varlen.varlen_attn` on a GPU (torch 2.10 takes `is_causal=True`, later
    releases `window_size=(-1, 0)`; its default scale is 1/sqrt(head size), ours too, where it takes none);
    on a CPU (the smoke) torch SDPA sample by sample."""
    if DEVICE != "cuda":
        def by_sample(q, k, v, cu, max_len, scale):
            bounds = cu.tolist()
            outs = [F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                                   scale=scale, enable_gqa=True).transpose(0, 1)
                    for a, b in zip(bounds, bounds[1:])]
            return torch.cat(outs)

        return by_sample, "torch SDPA sample by sample (CPU)"
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        kwargs: dict[str, object] = {"is_causal": True}
    elif "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    else:
        raise RuntimeError(f"torch {torch.__version__}'s varlen_attn takes neither is_causal nor window_size")
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    takes_scale = "scale" in params

    def call(q, k, v, cu, max_len, scale):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs, **({"scale": scale} if takes_scale else {}))

    return call, "torch.nn.attention.varlen.varlen_attn(" + ", ".join(f"{a}={b}" for a, b in kwargs.items()) + ")"


def _fwd_bwd(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> Callable:
    """A call of `fn(q, k, v)` forward and backward under `grad`: (out, dq, dk, dv)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def call():
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, grad))

    return call


def performance_checks(opts: Options, shape: Shape) -> list[Check]:
    """One rank (`one_rank_timing`) and virtual rings (`ring_timing`) at each token count of `shape`."""
    checks = []
    for tokens in shape.perf_tokens:
        name = f"{tokens_label(tokens)} tokens"
        checks += guarded(f"one rank {name}", one_rank_timing, opts, shape, tokens)
        if tokens == shape.perf_tokens[0] or not opts.quick:
            for size in shape.ring_sizes:
                checks += guarded(f"ring of {size} {name}", ring_timing, opts, shape, tokens, size)
    return checks


def _perf_inputs(shape: Shape, tokens: int) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...], float]:
    """(lengths, (q, k, v, grad) in bf16, scale) of a timing case: long-tailed samples, the longest a quarter."""
    lengths = long_tailed(tokens, tokens // 4, seed=1)
    inputs = _random_inputs(tokens, shape.perf_heads, shape.perf_kv_heads, shape.head_dim, shape.head_dim,
                            torch.bfloat16, seed=11)
    return lengths, inputs, shape.head_dim ** -0.5


def _reference(lengths: tuple[int, ...], inputs: tuple, scale: float) -> tuple[Callable, str, torch.Tensor]:
    """(fwd+bwd call, how it calls, its output) of torch's varlen attention over the whole samples; with K/V
    heads repeated to the query heads if this torch's `varlen_attn` refuses GQA (the same FLOPs)."""
    reference, how = torch_varlen()
    cu = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32, device=DEVICE)
    q, k, v, grad = inputs
    call = _fwd_bwd(lambda q, k, v: reference(q, k, v, cu, max(lengths), scale), q, k, v, grad)
    try:
        out = call()[0]
    except (RuntimeError, ValueError, TypeError) as e:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        call = _fwd_bwd(lambda q, k, v: reference(q, k, v, cu, max(lengths), scale), q, k, v, grad)
        out = call()[0]
        how += f" with K/V heads repeated (GQA refused: {type(e).__name__}: {str(e)[:120]})"
    return call, how, out.detach()


def _causal(kern, spans, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return kern.causal(q, k, v, spans, scale)


def one_rank_timing(opts: Options, shape: Shape, tokens: int) -> list[Check]:
    """What `dynamic_cp_attention` runs for a group of one (`kernel("varlen").causal` on the microbatch's
    `AttentionMeta`), forward + backward, against one call of torch's varlen attention over the same samples;
    and flex the same way (recorded). The smoke times `sdpa` in place of varlen, and no flex (no CPU backward)."""
    from megatron_dhp.runtime.attention.kernels import kernel
    from megatron_dhp.runtime.attention.meta import AttentionMeta

    lengths, inputs, scale = _perf_inputs(shape, tokens)
    reference, how, want = _reference(lengths, inputs, scale)
    meta = AttentionMeta.build(MicrobatchLayout(tuple(range(len(lengths))), lengths, 1, 0), DEVICE)
    timing = {"reps": shape.reps, "inner": shape.inner(tokens), "warmup": shape.warmup}
    ref_s = median_seconds(reference, **timing)
    flops = attention_flops(lengths, shape.perf_heads, shape.head_dim)
    common = {"tokens": tokens, "samples": len(lengths), "longest": max(lengths), "reference": how,
              "reference_ms": ref_s * 1e3, "reference_tflops": flops / ref_s / 1e12}
    checks = []
    backends = ("varlen", "flex") if DEVICE == "cuda" else ("sdpa",)
    for backend in backends:  # each on its own: one backend's exception keeps the others' figures
        name = f"one rank {tokens_label(tokens)} tokens: {backend} fwd+bwd vs {how.split('(')[0]}"
        why_not = kernel(backend).applies(DEVICE, torch.bfloat16, shape.head_dim)
        if why_not is not None:
            checks.append(Check(name, "skipped", reason=f"{backend}: {why_not}"))
            continue
        checks += guarded(name, _one_rank_backend, opts, name, backend, meta, inputs, scale, want, timing, ref_s,
                          flops, common)
    return checks


def _one_rank_backend(opts: Options, name: str, backend: str, meta, inputs: tuple, scale: float,
                      want: torch.Tensor, timing: dict, ref_s: float, flops: float, common: dict) -> list[Check]:
    """`one_rank_timing` of one backend against the reference measured once for all of them."""
    from megatron_dhp.runtime.attention.kernels import kernel

    ours = _fwd_bwd(partial(_causal, kernel(backend), meta.local, scale), *inputs)
    start = time.perf_counter()
    agreement = _scaled_error(ours()[0], want)  # the first call also builds what the backend caches
    first_s = time.perf_counter() - start
    ours_s = median_seconds(ours, **timing)
    numbers = {**common, "ours_ms": ours_s * 1e3, "ours_tflops": flops / ours_s / 1e12,
               "first_call_s": first_s, "output_vs_reference": agreement,
               "summary": f"{ours_s * 1e3:.2f} ms vs {ref_s * 1e3:.2f} ms"}
    if agreement > ATTENTION_TOLERANCE[torch.bfloat16]:
        return [Check(name, "fail", error=agreement, tolerance=ATTENTION_TOLERANCE[torch.bfloat16],
                      metric="max |ours - reference| / max(1, max |reference|)", numbers=numbers,
                      reason="the output differs from the reference's: the timing compares different work")]
    if backend == "flex":
        return [Check(name, "ok", reason=f"recorded: ratio {ours_s / ref_s:.3g}, no threshold",
                      numbers={**numbers, "ratio": ours_s / ref_s})]
    return [judged(name, ours_s / ref_s, PERF_TOLERANCE, f"{backend} / reference (median time)", opts, **numbers)]


def ring_timing(opts: Options, shape: Shape, tokens: int, size: int) -> list[Check]:
    """A ring of `size` virtual ranks on one device with no communication: every rank's blocks in ring order,
    merged by log-sum-exp (`ring.merged_blocks`), and each block's backward from the merged output and lse
    (the loops of `testing.virtual_group`'s ring, with the metadata and shards built outside the timing),
    against one call of torch's varlen attention over the whole samples (the same total work)."""
    from megatron_dhp.runtime.attention.kernels import kernel
    from megatron_dhp.runtime.attention.meta import AttentionMeta
    from megatron_dhp.runtime.fused import zigzag_pack, zigzag_unpack

    backend = "varlen" if DEVICE == "cuda" else "sdpa"
    lengths, inputs, scale = _perf_inputs(shape, tokens)
    reference, how, want = _reference(lengths, inputs, scale)
    ids = tuple(range(len(lengths)))
    metas = [AttentionMeta.build(MicrobatchLayout(ids, lengths, size, r), DEVICE) for r in range(size)]
    cu = metas[0].layout.cu_seqlens
    shards = [list(zigzag_pack(x, cu, size, None).chunk(size)) for x in inputs]
    ring = _ring_loops(*shards, metas, kernel(backend), scale)
    agreement = _scaled_error(zigzag_unpack(torch.cat(ring()[0]), cu, size, None), want)
    timing = {"reps": shape.reps, "inner": shape.inner(tokens), "warmup": shape.warmup}
    ring_s = median_seconds(ring, **timing)
    ref_s = median_seconds(reference, **timing)
    name = f"ring of {size} virtual ranks {tokens_label(tokens)} tokens: {backend} fwd+bwd vs {how.split('(')[0]}"
    numbers = {"tokens": tokens, "samples": len(lengths), "padded_tokens": size * metas[0].layout.num_slots,
               "ring_ms": ring_s * 1e3, "reference_ms": ref_s * 1e3, "reference": how,
               "output_vs_reference": agreement, "summary": f"{ring_s * 1e3:.2f} ms vs {ref_s * 1e3:.2f} ms"}
    if agreement > ATTENTION_TOLERANCE[torch.bfloat16]:
        return [Check(name, "fail", error=agreement, tolerance=ATTENTION_TOLERANCE[torch.bfloat16],
                      metric="max |ring - reference| / max(1, max |reference|)", numbers=numbers,
                      reason="the ring's output differs from the reference's")]
    tiles = ring_tile_ratio(lengths, size)
    numbers.update(tile_work_ratio=tiles, summary=f"{numbers['summary']}; tile work {tiles:.2f} x the reference's")
    return [judged(name, ring_s / ref_s, RING_TOLERANCE * tiles,
                   f"all virtual ranks / reference (median time); bound {RING_TOLERANCE} x their tile work", opts,
                   **numbers)]


def _ring_loops(qs: list, ks: list, vs: list, gs: list, metas: list, kern, scale: float) -> Callable:
    """Every virtual rank's ring forward and backward (as `testing.virtual_group` runs them): outputs, dq, and
    the dK/dV each rank's block accumulates over the ring, per rank."""
    from megatron_dhp.runtime.attention.math import accumulation_dtype
    from megatron_dhp.runtime.attention.ring import merged_blocks

    size = len(metas)

    def call():
        acc = accumulation_dtype(qs[0].dtype)
        dks, dvs = ([torch.zeros_like(x, dtype=acc) for x in xs] for xs in (ks, vs))
        outs, dqs = [], []
        for r, meta in enumerate(metas):
            sources = [(r - step) % size for step in range(size)]
            out, lse = merged_blocks(qs[r], [(meta.ring_block(s), ks[j], vs[j]) for s, j in enumerate(sources)],
                                     kern, meta, scale)
            out = out.to(qs[r].dtype)
            dq = torch.zeros_like(qs[r], dtype=acc)
            for s, j in enumerate(sources):
                gq, gk, gv = kern.block_backward(gs[r], qs[r], ks[j], vs[j], out, lse, meta.ring_block(s), meta, scale)
                dq += gq
                dks[j] += gk
                dvs[j] += gv
            outs.append(out)
            dqs.append(dq)
        return outs, dqs, dks, dvs

    return call


@contextlib.contextmanager
def one_rank_job(backend: str = "nccl") -> Iterator[None]:
    """This process as a job of one rank (NCCL; gloo in the CPU smoke) with megatron's parallel state (TE's
    modules and the step engine need it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dhp.launch.ranks import free_port
    from megatron_dhp.runtime.distributed import init_distributed

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        init_distributed(backend=backend)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():  # a later spawned job must not think it runs under torchrun
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ------------------------------------------------------------------------------------------------ kernels


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """`runtime.fused` on its torch fallback even for CUDA tensors (how it chooses: `fused._kernels`)."""
    from megatron_dhp.runtime import fused

    with mock.patch.object(fused, "_kernels", lambda t: None):
        yield


def median_seconds(fn: Callable[[], object], *, reps: int, inner: int = 5, warmup: int = 3) -> float:
    """Median over `reps` of the CUDA-event time of `inner` back-to-back calls, per call (after `warmup` calls);
    wall time where `DEVICE` is the CPU (the smoke)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if DEVICE != "cuda":
            begin = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - begin) / inner)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same bytes: equality is then bit equality, NaN payloads included."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _kernel_cases(quick: bool):
    """(name, call, compulsory bytes, exact) of each `runtime.fused` op on CUDA tensors."""
    from megatron_dhp.runtime.fused import gather_rows, lse_merge, scatter_rows, zigzag_pack, zigzag_unpack

    rows, width, d = (16384, 1024, 4) if quick else (65536, 2048, 4)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(rows, width, device=DEVICE, generator=gen).to(torch.bfloat16)
    row_bytes = width * x.element_size()
    rng = random.Random(1)
    lengths = []
    while sum(lengths) < rows:
        lengths.append(min(rng.randint(1, rows // 8), rows - sum(lengths)))
    cu = [0, *[sum(lengths[: i + 1]) for i in range(len(lengths))]]
    padded = sum(padded_length(n, d) for n in lengths)
    packed = zigzag_pack(x, cu, d, None)
    index = torch.randint(0, rows, (rows,), device=DEVICE, generator=gen)
    targets = rows + rows // 4
    perm = torch.randperm(targets, device=DEVICE, generator=gen)[:rows]
    blocks, tokens, heads, head_dim = 4, rows // 4, 16, 128
    outs = [torch.randn(tokens, heads, head_dim, device=DEVICE, generator=gen).to(torch.bfloat16)
            for _ in range(blocks)]
    lses = [torch.randn(tokens, heads, device=DEVICE, generator=gen) * 5 for _ in range(blocks)]
    return [
        (f"zigzag_pack {len(lengths)} samples d={d}", lambda: zigzag_pack(x, cu, d, None),
         copy_bytes(rows, padded, row_bytes), True),
        (f"zigzag_unpack {len(lengths)} samples d={d}", lambda: zigzag_unpack(packed, cu, d, None),
         copy_bytes(rows, rows, row_bytes), True),
        (f"gather_rows {rows} rows", lambda: gather_rows(x, index), copy_bytes(rows, rows, row_bytes, rows), True),
        (f"scatter_rows {rows} -> {targets} rows", lambda: scatter_rows(x, perm, targets),
         copy_bytes(rows, targets, row_bytes, rows), True),
        (f"lse_merge {blocks} blocks x {tokens} tokens", lambda: lse_merge(outs, lses),
         merge_bytes(blocks, tokens, heads, head_dim, 2), False),
    ]


def kernel_checks(quick: bool) -> list[Check]:
    """Each op's kernel against its torch path: equal results, both timed, the kernel's share of peak."""
    from megatron_dhp.runtime import fused

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = fused._load_kernels()
    if ops is None:
        why = (str(caught[0].message) if caught else "MEGATRON_DHP_CSRC=0" if os.environ.get("MEGATRON_DHP_CSRC") == "0"
               else "an earlier build failed (see its warning)")
        return [Check("csrc kernels", "skipped", reason=f"kernels not built: {why}")]
    peak = peak_gb_per_s(torch.cuda.get_device_name())
    reps = 5 if quick else 10
    checks = []
    for case in _kernel_cases(quick):
        checks += guarded(case[0], _compare_kernel, *case, peak, reps)
    return checks


def _compare_kernel(name: str, call: Callable, bytes_moved: int, exact: bool, peak: float | None,
                    reps: int) -> list[Check]:
    """One op on both paths: the results compared, each path timed."""
    got = call()
    with torch_path():
        want = call()
        torch_s = median_seconds(call, reps=reps)
    kernel_s = median_seconds(call, reps=reps)
    if exact:
        error, tol, metric = float(not torch.equal(_bits(got), _bits(want))), 0.0, "1 if any bit differs"
    else:
        error, tol = _scaled_error(got, want), MERGE_TOLERANCE[got.dtype]
        metric = "max |kernel - torch| / max(1, max |torch|)"
    kernel_gb = gb_per_s(bytes_moved, kernel_s)
    return [compared(name, error, tol, metric, bytes=bytes_moved, kernel_ms=kernel_s * 1e3, torch_ms=torch_s * 1e3,
                     kernel_gb_per_s=kernel_gb, torch_gb_per_s=gb_per_s(bytes_moved, torch_s), peak_gb_per_s=peak,
                     kernel_fraction_of_peak=kernel_gb / peak if peak else "unknown", speedup=torch_s / kernel_s)]


# --------------------------------------------------------------------------------------------- train step

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
)
"""Datasheet dense bf16 tensor-core TFLOP/s by a substring of the device name, first match wins."""
STEP_OVERHEAD_TOLERANCE = 0.05
"""Share of a training step the device may spend outside the model's forward and backward."""
STEP_WARMUP = 1
"""Steps run before anything is measured (allocator, first plan)."""


def peak_bf16_tflops(device_name: str) -> float | None:
    """The datasheet dense bf16 TFLOP/s of a device by name, or None when it is not in `PEAK_BF16_TFLOPS`."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


def step_model(opts: Options):
    """(GPT shape, tokens per microbatch, microbatches per step, measured steps): about 1.0B parameters (20
    layers of 2048, 16 query / 4 KV heads of 128, MLP 8192, 32K vocabulary) at 8K tokens per microbatch on a
    GPU; megatron-dhp's tiny test GPT in the CPU smoke."""
    from megatron_dhp.models.gpt import TinyGPTConfig

    if opts.smoke:
        return TinyGPTConfig(max_sequence_length=512), 256, 2, 2
    gpt = TinyGPTConfig(num_layers=20, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                        ffn_hidden_size=8192, vocab_size=32768, max_sequence_length=8192)
    return gpt, 8192, 4 if opts.quick else 8, 3 if opts.quick else 5


def train_step_checks(opts: Options) -> list[Check]:
    """Training steps of a ~1B megatron-core GPT (local layer spec, dynamic-CP attention, bf16) on a one-rank job
    through megatron-dhp's step engine, its planner and `run_step`, as `megatron-dhp train` runs them (forward,
    backward and the gradient reduction; the optimizer is left out): host syncs in the model, tokens/s, MFU
    and the share of the step outside the model's forward and backward."""
    if opts.smoke:
        if torch.cuda.is_available():
            return [Check("train step", "skipped", reason="the CPU smoke of a step needs a machine without CUDA "
                          "(megatron-core's CPU shims, launch.cpu_shim, apply only there)")]
        from megatron_dhp.launch.cpu_shim import apply_cpu_compat

        apply_cpu_compat()
    try:
        with one_rank_job("nccl" if DEVICE == "cuda" else "gloo"):
            return _train_steps(opts)
    finally:
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def build_step_gpt(gpt, dtype: torch.dtype):
    """megatron-core's GPTModel with megatron-dhp's local layer spec (`dhp_layer_spec`) in `dtype` on `DEVICE`,
    in megatron's DDP over the one-rank domain. `models.gpt.build_tiny_gpt` draws every weight on the host in
    fp32 (exact comparisons); a billion of them would take longer than the step, so the GPU build initialises on
    the device in bf16 from the same config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_dhp.runtime.layer_spec import dhp_layer_spec

    config = gpt.transformer_config()
    if dtype != torch.float32:
        config = dataclasses.replace(config, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                                     params_dtype=dtype, use_cpu_initialization=False)
    model = GPTModel(config=config, transformer_layer_spec=dhp_layer_spec(), vocab_size=gpt.vocab_size,
                     max_sequence_length=gpt.max_sequence_length, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False,
                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    model.to(device=DEVICE, dtype=dtype)  # torch's LayerNorm is built on the host in fp32
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    return model, DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


class ModelClock:
    """Device time inside the model's forward and backward: CUDA events (wall time on a CPU) around each GPT
    forward call and each microbatch's backward, read once the step is over."""

    def __init__(self) -> None:
        self.spans: list[tuple[object, object]] = []

    def mark(self) -> object:
        if DEVICE != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        start = self.mark()
        yield
        self.spans.append((start, self.mark()))

    def take(self) -> float:
        """Seconds of the spans so far (synchronising), then forget them."""
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            seconds = sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
        else:
            seconds = sum(b - a for a, b in self.spans)
        self.spans = []
        return seconds


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise at the first operation that makes the host wait for the device: `torch.cuda.set_sync_debug_mode
    ("error")` on a GPU, megatron-dhp's `NoHostSync` dispatch mode (its CPU stand-in) in the smoke."""
    if DEVICE != "cuda":
        from megatron_dhp.testing.host_sync import NoHostSync

        with NoHostSync():
            yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def wrapped_forwards(modules: list[torch.nn.Module], around: Callable[[], contextlib.AbstractContextManager]
                     ) -> Iterator[None]:
    """Each module's forward run inside `around()` (an instance attribute over the class's forward)."""
    for module in modules:
        def forward(*args, _inner=module.forward, **kwargs):
            with around():
                return _inner(*args, **kwargs)

        module.forward = forward
    try:
        yield
    finally:
        for module in modules:
            del module.forward


@contextlib.contextmanager
def wrapped_backward(around: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """The step runner's per-microbatch backward (`runtime.step._LossSum.backward`) run inside `around()`."""
    from megatron_dhp.runtime import step

    inner = step._LossSum.backward

    def backward(self, loss):
        with around():
            return inner(self, loss)

    with mock.patch.object(step._LossSum, "backward", backward):
        yield


def sync_site(error: BaseException) -> str:
    """'Type: first line of the message at file:line in function' of the innermost frame outside torch and the
    checks' own guards: where a host sync came from."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f"{os.sep}torch{os.sep}" not in f.filename and not f.filename.endswith(("host_sync.py", "gpu_check.py"))]
    where = ""
    if frames:
        f = frames[-1]
        path = f.filename.split(f"site-packages{os.sep}")[-1]
        path = os.path.relpath(path, ROOT) if path.startswith(str(ROOT)) else path
        where = f" at {path}:{f.lineno} in {f.name}"
    message = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {message[:200]}{where}"


def _train_steps(opts: Options) -> list[Check]:
    """The one-rank job's part of `train_step_checks`: build, warm up, probe for host syncs, time."""
    from megatron_dhp.integration.dhp_config import DhpConfig
    from megatron_dhp.integration.job_spec import JobSpec
    from megatron_dhp.integration.step_runtime import build_step_runtime
    from megatron_dhp.runtime.attention.core_attention import DynamicCPAttention
    from megatron_dhp.runtime.domain import DynamicDomain
    from megatron_dhp.runtime.step import run_step
    from megatron_dhp.runtime.step_data import local_slice
    from megatron_dhp.verify.selfcheck import random_samples
    from megatron_dhp.workload.sample import Batch

    started = time.perf_counter()
    gpt, cap, microbatches, measured = step_model(opts)
    dtype = torch.bfloat16  # the smoke too: the same build path (megatron-core runs bf16 on a CPU)
    model, ddp = build_step_gpt(gpt, dtype)
    build_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    matmul_params = params - model.embedding.word_embeddings.weight.numel()  # a lookup, not a matmul
    lengths = long_tailed(cap * microbatches, cap, seed=2)
    batch = Batch.from_lengths(lengths)
    domain = DynamicDomain.from_parallel_state()
    dhp = DhpConfig(max_tokens_per_rank=cap, adaptive=False, log_plans=False)
    # no model memory given: the one-rank job's cap stays as stated (its domain has no group family)
    runtime = build_step_runtime(JobSpec.for_domain(dhp, domain, world_size=1), domain, dataset_max_tokens=max(lengths))
    probes = ("forward+backward", "attention forward + backward") + (("warn",) if DEVICE == "cuda" else ())
    total = STEP_WARMUP + len(probes) + measured
    batches = iter([local_slice(random_samples(batch, vocab_size=gpt.vocab_size, seed=k), domain.position, domain.size)
                    for k in range(total)])
    engine = runtime.engine(source=lambda: next(batches, None), lookahead=True)
    clock = ModelClock()
    attention = [m for m in model.modules() if isinstance(m, DynamicCPAttention)]

    def step(guard_model: Callable | None = None, guard_attention: Callable | None = None,
             guard_backward: Callable | None = None) -> tuple[float, object]:
        ddp.zero_grad_buffer()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        inputs = engine.next()
        none = contextlib.nullcontext
        with (wrapped_forwards([model], guard_model or clock.span), wrapped_forwards(attention, guard_attention or none),
              wrapped_backward(guard_backward or clock.span)):
            result = run_step(engine, ddp, inputs)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, (inputs, result)

    syncs: dict[str, str | None] = {}
    sites: list[str] = []
    walls, model_s, plan_waits = [], [], []
    try:
        for _ in range(STEP_WARMUP):
            step()
        clock.take()
        for probe in probes:
            try:
                if probe == "forward+backward":
                    step(guard_model=no_host_sync, guard_backward=no_host_sync)
                elif probe == "attention forward + backward":
                    step(guard_attention=no_host_sync, guard_backward=no_host_sync)
                else:
                    sites = _sync_warnings(step)
                syncs[probe] = None
            except Exception as e:  # noqa: BLE001 - the sync debug mode's error or NoHostSync's
                syncs[probe] = sync_site(e)
            finally:
                clock.take()
        for k in range(measured):
            if k and time.perf_counter() - started > opts.step_limit_s:
                break
            wall, (inputs, result) = step()
            walls.append(wall)
            model_s.append(clock.take())
            plan_waits.append(engine.plan_wait_s)
    finally:
        runtime.planner.close()
    plan = inputs.plan
    step_s, inside_s = statistics.median(walls), statistics.median(model_s)
    tokens = sum(lengths)
    flops = 6 * matmul_params * tokens + attention_flops(lengths, gpt.num_attention_heads,
                                                        gpt.hidden_size // gpt.num_attention_heads) * gpt.num_layers
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    peak = peak_bf16_tflops(device)
    shape = (f"GPT {gpt.num_layers}x{gpt.hidden_size} ({params / 1e9:.2f}B params, {str(dtype).removeprefix('torch.')})"
             f", {tokens} tokens in {plan.num_microbatches} microbatches")
    numbers = {
        "params": params, "matmul_params": matmul_params, "tokens_per_step": tokens, "samples": len(lengths),
        "microbatches": plan.num_microbatches, "plan": plan.summary(), "build_s": build_s,
        "steps_measured": len(walls), "step_ms": [w * 1e3 for w in walls], "model_ms": [m * 1e3 for m in model_s],
        "plan_wait_ms": [p * 1e3 for p in plan_waits], "median_step_ms": step_s * 1e3,
        "median_model_ms": inside_s * 1e3, "tokens_per_s": tokens / step_s, "flops_per_step": flops,
        "peak_bf16_tflops": peak, "mfu": flops / step_s / (peak * 1e12) if peak else "unknown",
        "mfu_inside_model": flops / inside_s / (peak * 1e12) if peak else "unknown",
        "loss": result.loss_sum / result.global_loss_tokens,
    }
    numbers["summary"] = (f"{numbers['tokens_per_s']:.0f} tokens/s, MFU "
                          + (f"{numbers['mfu']:.1%}" if peak else "unknown") + f", step {step_s * 1e3:.1f} ms")
    overhead = max(0.0, 1 - inside_s / step_s)
    checks = [judged(f"{shape}: share of the step outside the model's forward/backward", overhead,
                     STEP_OVERHEAD_TOLERANCE, "1 - model forward+backward device time / step wall time", opts,
                     **numbers)]
    what = {"forward+backward": "the GPT's forward and every microbatch's backward",
            "attention forward + backward": "megatron-dhp's core attention forward and every backward"}
    for probe, label in what.items():
        name = f"no host sync in {label} ({'sync debug mode error' if DEVICE == 'cuda' else 'NoHostSync'})"
        found = syncs[probe]
        if found is None:
            checks.append(Check(name, "ok"))
        elif "megatron_dhp" not in found:  # megatron-core's own (its cross entropy's boolean index): upstream's
            checks.append(Check(name, "ok", reason=f"none from megatron-dhp; the first is upstream's: {found}",
                                numbers={"first": found}))
        elif opts.smoke:
            checks.append(Check(name, "ok", reason=f"CPU smoke, not judged: {found}", numbers={"first": found}))
        else:
            checks.append(Check(name, "fail", reason=found, numbers={"first": found}))
    if "warn" in syncs:  # informational: what the step around the model waits for is in the share above
        name = "host syncs anywhere in one step (sync debug mode warn: engine, metadata, loss, model)"
        checks.append(Check(name, "ok", reason=f"{len(sites)} site(s)" if syncs["warn"] is None else syncs["warn"],
                            numbers={"sites": sites}))
    return checks


def _sync_warnings(step: Callable) -> list[str]:
    """Every distinct 'file:line: message' the CUDA sync debug mode warns of during one whole step: the engine's
    gather, plan and dispatch, each microbatch's metadata, loss and model (a backward's warning is replayed
    where the backward was called)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found = [f"{w.filename.split(f'site-packages{os.sep}')[-1]}:{w.lineno}: {str(w.message).splitlines()[0][:120]}"
             for w in caught if "synchroniz" in str(w.message)]
    return list(dict.fromkeys(found))


# -------------------------------------------------------------------------------------------- calibration


def calibration_config(quick: bool):
    """A one-rank job of a GPT big enough that a microbatch is GPU work rather than launch overhead."""
    from megatron_dhp.integration.dhp_config import DhpConfig
    from megatron_dhp.training.config import ModelConfig, RunConfig, TrainConfig

    if quick:
        model = ModelConfig(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=4,
                            ffn_hidden_size=2048, vocab_size=8192, max_sequence_length=4096)
        cap = 4096
    else:
        model = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                            ffn_hidden_size=4096, vocab_size=32768, max_sequence_length=8192)
        cap = 8192
    return TrainConfig(model=model, train=RunConfig(nproc=1), dhp=DhpConfig(max_tokens_per_rank=cap))


def calibrate(config, lengths: tuple[int, ...], reps: int) -> list[Check]:
    """`profile`'s grid timing and fit on the config's ranks; the check is the fit's median error."""
    from megatron_dhp.cost.fit import default_grid
    from megatron_dhp.training.profile import profile

    grid = default_grid(num_ranks=config.train.num_ranks, max_tokens_per_rank=config.dhp.max_tokens_per_rank,
                        lengths=lengths)
    report = profile(config, grid=grid, reps=reps, steps=0)
    errors = [abs(e) for e in report.errors]
    c = report.cost
    coefficients = {"attn_s_per_token2": c.attn_s_per_token2, "linear_s_per_token": c.linear_s_per_token,
                    "microbatch_overhead_s": c.microbatch_overhead_s, "sample_overhead_s": c.sample_overhead_s}
    points = [{"point": p.describe(), "measured_ms": m * 1e3, "predicted_ms": f * 1e3, "error": e}
              for p, m, f, e in zip(report.grid, report.measured, report.fitted, report.errors)]
    model = config.model
    return [compared(f"fit of GPT {model.num_layers}x{model.hidden_size} on {len(grid)} points",
                     statistics.median(errors), FIT_TOLERANCE, "median |predicted / measured - 1|",
                     max_error=max(errors), coefficients=coefficients, points=points)]


def calibration_section(quick: bool) -> list[Check]:
    """`calibrate` at lengths sized to the budget."""
    lengths, reps = ((256, 512, 1024, 2048), 3) if quick else ((512, 1024, 2048, 4096), 5)
    return calibrate(calibration_config(quick), lengths, reps)


# -------------------------------------------------------------------------------------------- closed loop

LOOP_TOLERANCE = 0.10
"""A step's predicted forward+backward time counts as right within this of the measured one."""
LOOP_WARMUP = 8
"""Steps the closed loop has to find the time scale before its predictions are counted."""


def slot_timer_check() -> Check:
    """The slot clock's CUDA events (read a step late, no synchronisation) against synchronised wall time."""
    from megatron_dhp.closed_loop.slot_clock import SlotClock

    timer = SlotClock(torch.device(DEVICE))
    a = torch.randn(4096, 4096, device=DEVICE)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with timer.slot((0,)):
        for _ in range(20):
            a = torch.tanh(a @ a / 64)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    timer.end_step("step")
    _, slots, _ = timer.take()
    events = slots[0][1]
    return compared("slot timer: CUDA events vs synchronised wall time", abs(events / wall - 1), LOOP_TOLERANCE,
                    "|events / wall - 1|", events_ms=events * 1e3, wall_ms=wall * 1e3)


def closed_loop_checks(quick: bool) -> list[Check]:
    """A one-rank train run planned with a cost model far off this GPU (gpt7b-64: GPT-7B on A100s): the loop's
    predicted forward+backward time against the measured one after `LOOP_WARMUP` steps."""
    from megatron_dhp.training.config import DataConfig
    from megatron_dhp.training.train import train

    base = calibration_config(quick)
    steps = 16 if quick else 30
    config = base.with_overrides(train={"steps": steps, "warmup_steps": 2}, dhp={"cost": "gpt7b-64", "truncate": True})
    config = type(config)(model=config.model, train=config.train, dhp=config.dhp,
                          data=DataConfig(source="wlbllm", length_scale=1 / 16, global_batch=16, seed=0))
    records = train(config, show=False).records
    after = records[LOOP_WARMUP:]
    errors = [abs(r.predicted_s / r.measured_s - 1) for r in after]
    share = sum(e <= LOOP_TOLERANCE for e in errors) / len(errors)
    steps_data = [{"step": r.step, "predicted_s": r.predicted_s, "measured_s": r.measured_s} for r in records]
    first = [abs(r.predicted_s / r.measured_s - 1) for r in records[:LOOP_WARMUP]]
    return [slot_timer_check(),
            compared(f"closed loop from gpt7b-64's coefficients: steps {LOOP_WARMUP + 1}-{steps} predicted within "
                     f"{LOOP_TOLERANCE:.0%}", 1 - share, 0.10, "share of steps outside the tolerance",
                     median_error=statistics.median(errors), median_error_first_steps=statistics.median(first),
                     steps=steps_data)]


# ---------------------------------------------------------------------------------------------- sharding


def sharding_checks(quick: bool) -> list[Check]:
    """megatron-core's torch FSDP2 wrapper on a one-rank NCCL job (`selftest --fsdp`'s check): loss and every
    gradient of a two-microbatch step against one process, the CUDA path of the sharded model and its
    summed gradient reduction (a multi-rank domain needs more GPUs)."""
    from megatron_dhp.plan.plan import Plan, PlanGroup
    from megatron_dhp.verify.selfcheck import TOLERANCE, SelfCheck, random_samples
    from megatron_dhp.workload.sample import Batch

    batch = Batch.from_lengths([24, 7, 40, 13])
    ids = [s.id for s in batch.samples]
    plan = Plan("gpu-check", 1, 1, batch.samples, (PlanGroup((0,), (tuple(ids[:2]), tuple(ids[2:]))),))
    with one_rank_job():
        check = SelfCheck(seed=0, fsdp=True)
        result = check.check(plan, random_samples(batch, vocab_size=check.config.vocab_size, seed=0), "allgather")
    return [compared("torch FSDP2 on one NCCL rank: loss and every gradient against one process",
                     max(result.max_loss_diff, result.max_grad_diff), TOLERANCE, "max abs difference",
                     loss=result.loss, tokens=result.tokens_computed, batch_tokens=result.batch_tokens)]


def safety_checks(quick: bool) -> list[Check]:
    """What only a GPU shows of a step's safety. Multi-token prediction and MoE's load-balancing loss on one NCCL
    rank (`selftest --mtp 1` and `--model moe`'s checks): their loss scales must sit on the model's device, or
    megatron-core's backward refuses them. And the
    mechanism behind the overlapped reduction's rule (`slots.last_backward_shared`): with
    CUDA_DEVICE_MAX_CONNECTIONS=1 a tiny kernel on a second stream must wait for a long one queued before it
    on the first (head-of-line blocking), measured in a subprocess, since CUDA reads the variable at start-up;
    recorded, the rule does not depend on it. And a Megatron-LM-style default group bound by megatron-dhp, its
    groups split and connected at set-up (`megatron_default_group_check`), NVLink SHARP off and on."""
    from dataclasses import replace as with_fields

    from megatron_dhp.models.gpt import TinyGPTConfig
    from megatron_dhp.plan.plan import Plan, PlanGroup
    from megatron_dhp.verify.selfcheck import TOLERANCE, SelfCheck, random_samples
    from megatron_dhp.workload.sample import Batch

    batch = Batch.from_lengths([24, 7, 40, 13])
    ids = [s.id for s in batch.samples]
    plan = Plan("gpu-check", 1, 1, batch.samples, (PlanGroup((0,), (tuple(ids[:2]), tuple(ids[2:]))),))
    single = Plan("gpu-check", 1, 1, batch.samples, (PlanGroup((0,), tuple((i,) for i in ids)),))
    cases = {"multi-token prediction": (with_fields(TinyGPTConfig(), mtp_num_layers=1), plan),
             # the load-balancing loss is per microbatch: one sample each, as one process computes it
             "MoE with its load-balancing loss": (with_fields(TinyGPTConfig(), num_experts=4, moe_aux_loss_coeff=0.1),
                                                  single)}
    checks = []
    for name, (config, case) in cases.items():
        with one_rank_job():
            check = SelfCheck(config=config, seed=0)
            result = check.check(case, random_samples(batch, vocab_size=config.vocab_size, seed=0), "allgather")
        checks.append(compared(f"{name} on one NCCL rank: loss and every gradient against one process",
                               max(result.max_loss_diff, result.max_grad_diff), TOLERANCE, "max abs difference",
                               loss=result.loss))
    probe = ("import time, torch\n"
             "a, b = torch.cuda.Stream(), torch.cuda.Stream()\n"
             "x = torch.zeros(1, device='cuda'); torch.cuda.synchronize()\n"
             "with torch.cuda.stream(a): torch.cuda._sleep(int(5e8))\n"
             "start = time.perf_counter()\n"
             "with torch.cuda.stream(b): x.add_(1)\n"
             "b.synchronize(); print(time.perf_counter() - start)\n")
    waits = {}
    for connections in ("1", "8"):
        env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": connections}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        waits[connections] = float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else out.stderr[-300:]
    checks.append(Check("head-of-line blocking: a second stream's kernel behind a long one (seconds waited)", "ok",
                        numbers={"CUDA_DEVICE_MAX_CONNECTIONS=1": waits["1"], "CUDA_DEVICE_MAX_CONNECTIONS=8": waits["8"]}))
    return checks + [megatron_default_group_check(nvls) for nvls in ("0", "1")]


MEGATRON_GROUP_PROBE = """
import json, os, sys, torch, torch.distributed as dist
from megatron_dhp.runtime.distributed import bind_default_group, gpu_environment
from megatron_dhp.runtime.group_pool import nccl_sharing
gpu_environment()  # what validate_dhp_args does before Megatron-LM starts NCCL
torch.cuda.set_device(0)
dist.init_process_group("nccl")  # as Megatron-LM's initialize_megatron: no device_id
x = torch.ones(1, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
before, groups, device = nccl_sharing(), int(sys.argv[1]), torch.device("cuda", 0)
free = torch.cuda.mem_get_info()[0]
bound = bind_default_group(device)
made = [dist.new_group([0]) for _ in range(groups)]  # the group pool's creation, no collective on them
torch.cuda.synchronize()
used = (free - torch.cuda.mem_get_info()[0]) / groups / 2**20
splits = dist.group.WORLD._get_backend(device).comm_split_count()
print(json.dumps({"bound": bound, "splits": splits, "mib_per_group": used, "before": before, "after": nccl_sharing()}))
dist.destroy_process_group()
"""
"""A Megatron-LM-style default group (no device_id) on one NCCL rank, bound by megatron-dhp, then K groups."""


def megatron_default_group_check(nvls: str, groups: int = 4) -> Check:
    """Under Megatron-LM (default group without a device) `bind_default_group` makes every new group a split of
    the default communicator (NCCL's split count), connected at creation (memory taken before any collective on
    it), sharing resources (the start-up line). Memory per group with NVLink SHARP off and on (one GPU: no
    NVLS buffers expected; the multi-GPU figure is bench/comm_memory.py's)."""
    from megatron_dhp.launch.ranks import free_port

    name = f"Megatron-LM-style default group bound, {groups} groups split and connected at set-up (NCCL_NVLS_ENABLE={nvls})"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "NCCL_NVLS_ENABLE": nvls}
    out = subprocess.run([sys.executable, "-c", MEGATRON_GROUP_PROBE, str(groups)], env=env, capture_output=True,
                         text=True, timeout=180)
    if out.returncode != 0:
        return Check(name, "fail", reason=out.stderr[-600:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ok = got["bound"] and got["splits"] == groups and got["mib_per_group"] > 0 and "sharing its resources" in got["after"]
    return Check(name, "ok" if ok else "fail", numbers=got)


# ----------------------------------------------------------------------------------------------- the run

SECTIONS: dict[str, Callable[[Options], list[Check]]] = {
    "attention": attention_checks,  # first: the most valuable; it builds the csrc kernels the others use
    "train_step": train_step_checks,
    "kernels": lambda opts: kernel_checks(opts.quick),
    "calibration": lambda opts: calibration_section(opts.quick),
    "closed_loop": lambda opts: closed_loop_checks(opts.quick),
    "sharding": lambda opts: sharding_checks(opts.quick),
    "safety": lambda opts: safety_checks(opts.quick),
}
SMOKE_SECTIONS = ("attention", "train_step")
"""What `--cpu-smoke` runs on the CPU; the others need CUDA."""
QUICK_SECTIONS = ("attention", "train_step", "safety")
"""What `--quick` runs: the attention's exactness and speed, a training step's, and the safety checks."""
SECTION_CAP_S: dict[str, tuple[float, float]] = {
    "attention": (200.0, 360.0), "train_step": (100.0, 300.0), "kernels": (60.0, 120.0),
    "calibration": (90.0, 180.0), "closed_loop": (90.0, 180.0), "sharding": (60.0, 120.0), "safety": (60.0, 120.0)}
"""Seconds (--quick, full) after which a section starts no more checks: --quick's three fit 6 minutes with room
for start-up, the full run 10 minutes with most sections finishing well before their caps."""
_deadline: list[float] = [math.inf, math.inf]
"""When the running section's cap passes (perf_counter) and the cap itself, for `guarded`."""


def run_section(name: str, opts: Options) -> Section:
    """One section, timed and capped; an exception anywhere in it is its failure, not the run's."""
    start = time.perf_counter()
    cap = SECTION_CAP_S[name][0 if opts.quick else 1]
    _deadline[:] = [start + cap, cap]
    try:
        checks = SECTIONS[name](opts)
    except Exception as e:
        last = traceback.extract_tb(e.__traceback__)[-1]
        checks = [Check(name, "fail", reason=f"{type(e).__name__}: {e} ({Path(last.filename).name}:{last.lineno})")]
    finally:
        _deadline[:] = [math.inf, math.inf]
    return Section(name, section_status(checks), time.perf_counter() - start, skip_reason(checks), checks)


def summary(sections: list[Section], device: str | None) -> Table:
    """One row per check: status, error against tolerance, and the numbers a reader looks for first."""
    table = Table(title=f"GPU check on {device or NO_CUDA}")
    for col in ("section", "check", "status", "error / tol", "detail"):
        table.add_column(col)
    colour = {"ok": "green", "fail": "red", "skipped": "yellow"}
    for s in sections:
        table.add_row(f"{s.name} ({s.seconds:.1f}s)", "", f"[{colour[s.status]}]{s.status}", "", s.reason or "")
        for c in s.checks:
            err = "" if c.error is None else f"{c.error:.3g}" + ("" if c.tolerance is None else f" / {c.tolerance:.3g}")
            n = c.numbers
            detail = (f"kernel {n['kernel_gb_per_s']:.0f} GB/s, torch {n['torch_gb_per_s']:.0f} GB/s"
                      if "kernel_gb_per_s" in n else "; ".join(filter(None, (n.get("summary"), c.reason))))
            table.add_row("", c.name, f"[{colour[c.status]}]{c.status}", err, detail)
    return table


def write_report(path: str, sections: list[Section], device: str | None, quick: bool, start: float) -> dict:
    """Write the report of the sections run so far; returns it."""
    report = build_report(sections, device=device, quick=quick, total_seconds=time.perf_counter() - start)
    Path(path).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return report


def _section_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", metavar="JSON", help="report path (default gpu_check.json)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions, bf16 only")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help=f"run {' and '.join(SMOKE_SECTIONS)} on the CPU with tiny sizes, timings not judged")
    parser.add_argument("--only", type=_section_names, metavar="SECTIONS", help="comma-separated sections to run")
    parser.add_argument("--skip", type=_section_names, default=[], metavar="SECTIONS",
                        help="comma-separated sections to skip (e.g. train_step)")
    parser.add_argument("--step-limit", type=float, default=Options.step_limit_s, metavar="SECONDS",
                        help=f"train_step stops measuring after this long (default {Options.step_limit_s:.0f})")
    args = parser.parse_args(argv)
    opts = Options(quick=args.quick, smoke=args.cpu_smoke, step_limit_s=args.step_limit)
    selected = [n for n in (args.only or (QUICK_SECTIONS if args.quick else SECTIONS)) if n not in args.skip]
    console = Console()
    start = time.perf_counter()
    if args.cpu_smoke:
        DEVICE = "cpu"
        device = "cpu (smoke)"
        torch.set_num_threads(1)  # on a busy CPU, OpenMP's waiting threads turned 6 ms calls into 1 s ones
    else:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if device is None:
        console.print(f"{NO_CUDA}: every GPU check skipped")
        sections = [Section(name, "skipped", 0.0, NO_CUDA) for name in SECTIONS]
    else:
        sections = []
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("GPU check", total=len(SECTIONS))
            for name in SECTIONS:
                progress.update(task, description=name)
                if name not in selected:
                    why = "not part of --quick" if args.quick and not args.only and name not in QUICK_SECTIONS else \
                        "not selected (--only / --skip)"
                    sections.append(Section(name, "skipped", 0.0, why))
                elif opts.smoke and name not in SMOKE_SECTIONS:
                    sections.append(Section(name, "skipped", 0.0, "needs CUDA (not part of the CPU smoke)"))
                else:
                    sections.append(run_section(name, opts))
                write_report(args.out, sections, device, args.quick, start)  # a run cut short keeps what it did
                progress.advance(task)
        console.print(summary(sections, device))
    report = write_report(args.out, sections, device, args.quick, start)
    console.print(f"{report['status']} in {report['total_seconds']:.1f}s; wrote {args.out} (exit {report['exit_code']})")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
