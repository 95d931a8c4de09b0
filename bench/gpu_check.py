"""One GPU check: every CUDA path against its reference, written to one JSON report.

Sections, each timed, each check ok / fail (with its error and tolerance) / skipped (with why):

1. kernels (first: their JIT build is timed here, and flash attention uses them): the `csrc` kernels behind
   `runtime.fused` against the torch fallback on CUDA tensors (copies bit for bit, `lse_merge` to float
   rounding), each path's effective GB/s (compulsory bytes / median time, CUDA events) and the kernels'
   share of the device's peak memory bandwidth.
2. attention: the `flash` (flash-attn varlen) and `sdpa` backends of `runtime.attention.kernels.attend`, and
   TransformerEngine's core attention of the `te` layer spec (in a one-rank NCCL job), against the `math`
   reference (fp32) on random zigzag layouts in one process (a group of one, and a group of 4 seen from one
   rank: its own shards or, as Ulysses, all of them); bf16/fp16, forward and backward.
3. calibration: `megatron-dhp profile`'s timing and fit (`training.profile.profile`, one spawned NCCL rank)
   on a GPT at a few lengths: the fitted coefficients and each point's predicted vs measured time.
4. closed loop: the slot timer's CUDA events against synchronised wall time, and a one-rank train run
   planned with a cost model far off this GPU, whose closed loop must bring the predicted step time
   within 10 % of the measured one on 90 % of the steps after a warm-up.
5. sharding: megatron-core's torch FSDP2 wrapper (`selftest --fsdp`) on a one-rank NCCL job, loss and every
   gradient against one process.

Exit status: 0 when every check that ran passed, 1 when one failed, 3 when none ran (no CUDA device: every
section is skipped, so a user or CI sees that nothing was checked). Budget: under 8 minutes on an H200.

    python bench/gpu_check.py [--out gpu_check.json] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import random
import statistics
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
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megatron_dhp.runtime.attention import flash
from megatron_dhp.runtime.attention.kernels import attend
from megatron_dhp.runtime.attention.tokens import Tokens
from megatron_dhp.runtime.layout import MicrobatchLayout, padded_length

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NOTHING_CHECKED = 3
NO_CUDA = "no CUDA device"
DEVICE = "cuda"
"""Where the checks put their tensors (a name, so that their logic can be tried on the CPU)."""

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
    """`fn(*args)`, or one failed check carrying the exception when it raises (one broken path fails alone)."""
    try:
        return fn(*args)
    except Exception as e:
        last = traceback.extract_tb(e.__traceback__)[-1]
        return [Check(name, "fail", reason=f"{type(e).__name__}: {e} ({Path(last.filename).name}:{last.lineno})")]


# ---------------------------------------------------------------------------------------------- attention


def _layouts(quick: bool, seed: int = 0):
    """(name, layout, queries, keys) of the cases: a one-rank group, and rank 1 of a group of 4 attending its
    own shards over the group's keys (all-gather) or the whole group's queries (Ulysses)."""
    rng = random.Random(seed)
    count, longest = (6, 512) if quick else (12, 1536)
    lengths = tuple(rng.randint(1, longest) for _ in range(count))
    one = MicrobatchLayout(tuple(range(count)), lengths, 1, 0)
    four = MicrobatchLayout(tuple(range(count)), lengths, 4, 1)
    whole_one = Tokens(one.local_positions, one.segments, whole_samples=one)
    group = Tokens(four.group_positions, four.group_segments, whole_samples=four)
    own = Tokens(four.local_positions, four.segments)
    return [
        ("one rank", one, whole_one, whole_one),
        ("d=4 own shards", four, own, group),
        ("d=4 ulysses", four, group, group),
    ]


def _attention_grads(fn, q, k, v, grad):
    """(out, dq, dk, dv) of `fn(q, k, v)` under an output gradient."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype)))


def _scaled_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| per unit of max(1, max |want|)."""
    diff = (got.float() - want.float()).abs().max().item()
    return diff / max(1.0, want.float().abs().max().item())


HEAD_SHAPES = ((128, 128, ""), (192, 128, " mla"))
"""(query/key head size, value head size, name suffix) of the attention checks."""


def attention_checks(quick: bool) -> list[Check]:
    """Every CUDA attention backend against `math` in fp32, forward and backward, on each layout."""
    heads, kv_heads = 8, 2
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)
    te_missing = importlib.util.find_spec("transformer_engine") is None
    checks: list[Check] = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for case, layout, queries, keys in _layouts(quick):
        tq, tk = len(queries.positions), len(keys.positions)
        # the usual 128-wide heads, and in bf16 MLA's: Q/K 192 wide (128 + a 64-wide RoPE part), V 128
        for dtype, (qk_dim, v_dim, shape) in [(d, s) for d in dtypes for s in HEAD_SHAPES[: 2 if d == torch.bfloat16 else 1]]:
            scale = qk_dim**-0.5
            q = torch.randn(tq, heads, qk_dim, device=DEVICE, generator=gen).to(dtype)
            k = torch.randn(tk, kv_heads, qk_dim, device=DEVICE, generator=gen).to(dtype)
            v = torch.randn(tk, kv_heads, v_dim, device=DEVICE, generator=gen).to(dtype)
            grad = torch.randn(tq, heads, v_dim, device=DEVICE, generator=gen)
            inputs = (q, k, v, grad)
            tokens = {"queries": queries, "keys": keys, "scale": scale}
            want = _attention_grads(partial(attend, **tokens, backend="math"), q.float(), k.float(), v.float(), grad)
            skip = {
                "flash": None if flash.usable(q) else "flash-attn not installed",
                "sdpa": None,
                "te": "transformer-engine not installed" if te_missing else
                      "MLA's head shapes are not wired to TE here" if shape else
                      None if layout.group_size == 1 else "TE's context parallelism needs a group of ranks",
            }
            for backend, why_not in skip.items():
                name = f"{backend} {case}{shape} {str(dtype).removeprefix('torch.')}"
                if why_not:
                    checks.append(Check(name, "skipped", reason=why_not))
                    continue
                checks += guarded(name, _compare_attention, name, backend, layout, tokens, inputs, want)
    return checks


def _compare_attention(name: str, backend: str, layout: MicrobatchLayout, tokens: dict, inputs: tuple,
                       want: tuple) -> list[Check]:
    """Forward and backward of one backend against the reference's (out, dq, dk, dv)."""
    q, k, v, grad = inputs
    with one_rank_job() if backend == "te" else contextlib.nullcontext():
        fn = te_attention(layout, tokens["scale"]) if backend == "te" else partial(attend, **tokens, backend=backend)
        got = _attention_grads(fn, q, k, v, grad)
    tol = ATTENTION_TOLERANCE[q.dtype]
    metric = "max |got - fp32 math| / max(1, max |math|)"
    forward = _scaled_error(got[0], want[0])
    backward = max(_scaled_error(g, w) for g, w in zip(got[1:], want[1:]))
    return [compared(f"{name} forward", forward, tol, metric, query_tokens=int(q.shape[0])),
            compared(f"{name} backward", backward, tol, metric, query_tokens=int(q.shape[0]))]


def te_attention(layout: MicrobatchLayout, scale: float) -> Callable:
    """TransformerEngine's core attention of the `te` layer spec on a one-rank group's THD microbatch."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dhp.runtime.attention.context import CPContext, DhpPackedSeqParams
    from megatron_dhp.runtime.layer_spec import dhp_layer_spec

    core = dhp_layer_spec(backend="te").submodules.self_attention.submodules.core_attention
    params = DhpPackedSeqParams.for_microbatch(CPContext(layout, None), device=DEVICE)

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


@contextlib.contextmanager
def one_rank_job() -> Iterator[None]:
    """This process as a job of one NCCL rank with megatron's parallel state (TE's modules need it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dhp.runtime.distributed import init_distributed
    from megatron_dhp.testing.launch import free_port

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        init_distributed(backend="nccl")
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


def median_seconds(fn: Callable[[], object], *, reps: int, inner: int = 5) -> float:
    """Median over `reps` of the CUDA-event time of `inner` back-to-back calls, per call (after a warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
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
    """The SlotTimer's CUDA events (read a step late, no synchronisation) against synchronised wall time."""
    from megatron_dhp.runtime.slot_timer import SlotTimer

    timer = SlotTimer(torch.device(DEVICE))
    a = torch.randn(4096, 4096, device=DEVICE)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with timer.slot((0,)):
        for _ in range(20):
            a = torch.tanh(a @ a / 64)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    timer.end_step("step")
    _, slots = timer.take()
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
    from megatron_dhp.testing.selfcheck import TOLERANCE, SelfCheck, random_samples
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


# ----------------------------------------------------------------------------------------------- the run

SECTIONS: dict[str, Callable[[bool], list[Check]]] = {
    "kernels": kernel_checks,  # first: the kernels' JIT build is timed here, and flash attention uses them
    "attention": attention_checks,
    "calibration": calibration_section,
    "closed_loop": closed_loop_checks,
    "sharding": sharding_checks,
}


def run_section(name: str, quick: bool) -> Section:
    """One section, timed; an exception anywhere in it is its failure, not the run's."""
    start = time.perf_counter()
    checks = guarded(name, SECTIONS[name], quick)
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
            err = "" if c.error is None else f"{c.error:.3g} / {c.tolerance:.3g}"
            n = c.numbers
            detail = (f"kernel {n['kernel_gb_per_s']:.0f} GB/s, torch {n['torch_gb_per_s']:.0f} GB/s"
                      if "kernel_gb_per_s" in n else c.reason or "")
            table.add_row("", c.name, f"[{colour[c.status]}]{c.status}", err, detail)
    return table


def write_report(path: str, sections: list[Section], device: str | None, quick: bool, start: float) -> dict:
    """Write the report of the sections run so far; returns it."""
    report = build_report(sections, device=device, quick=quick, total_seconds=time.perf_counter() - start)
    Path(path).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", metavar="JSON", help="report path (default gpu_check.json)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions, bf16 only")
    args = parser.parse_args(argv)
    console = Console()
    start = time.perf_counter()
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
                sections.append(run_section(name, args.quick))
                write_report(args.out, sections, device, args.quick, start)  # a run cut short keeps what it did
                progress.advance(task)
        console.print(summary(sections, device))
    report = write_report(args.out, sections, device, args.quick, start)
    console.print(f"{report['status']} in {report['total_seconds']:.1f}s; wrote {args.out} (exit {report['exit_code']})")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
