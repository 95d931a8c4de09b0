"""Host time per attention layer of the dynamic-CP variants, before and after the per-microbatch metadata.

On a GPU the attention arithmetic runs asynchronously; what the host spends per layer (Python, masks and
indices built on the host, kernel dispatch) is what the GPU may wait for. This bench measures exactly that:
q, k and v live on torch's `meta` device (shapes only, no kernel runs), so the time of one layer's forward +
backward on one rank is the host's alone. BEFORE is revision 457d665 (dense masks built on the host per ring
step and layer, a Python loop over samples with `unique`/`nonzero`/`tolist`), run in a subprocess on a
temporary git worktree; AFTER is the working tree, which builds an `AttentionMeta` once per microbatch
(`CPContext(..., device="meta")`, timed apart: the `meta build ms` column) and does no host work per layer.

Per case (tokens T, group size d, variant) one rank (group rank d // 2) runs one layer of 32 query heads,
8 KV heads, head dim 128, bf16. Communication is stubbed (no process group): `start_shift`, `all_gather` and
`all_to_all` are replaced, in the namespaces the variant modules imported them into, by shape-only stand-ins
that keep the autograd graph (their backward returns the adjoint's shape). A group of one rank runs only the
one-rank path (`local`, no communication), reported once. Before, backend `auto` on a non-CUDA tensor takes
`sdpa` (`_sdpa_by_sample`) and the ring its CPU kernel path (`blocks.chunks` masks); after, the kernels are
called directly, bypassing `resolve` (which refuses meta): `varlen` (torch's flash-attention varlen kernels,
what a GPU runs in bf16) and `sdpa` (like for like with before). Where this torch lacks a meta kernel for the
ops a path calls (`aten._flash_attention_forward`/`_backward` after; `_scaled_dot_product_flash_attention_for_cpu`
and its backward in the old ring's `blocks.CpuFlashKernel`), the after side falls back to `sdpa` (and says so)
and the old ring's kernel is replaced by one returning empty tensors of the right shapes: the host work
measured there is the mask building. torch 2.13 has all four, so neither substitution happens on it.

Sample lengths (long-tailed, fixed seed): T/4, T/8 and T/8 tokens, then samples drawn uniformly from
[64, 1024] tokens (`random.Random(seed)`) until T is reached, a remainder under 64 added to the last one.

Timing: thread CPU time of the one thread doing the work (`time.thread_time`, torch held to one intra-op
thread), robust to other load on a shared machine (`--wall` for wall time); the median of up to `--repeats`
calls after one warm-up call (which fills the per-microbatch caches of both revisions: the old layout's
cached positions, the new metadata's per-backend tables), fewer while a case's calls exceed `--budget`
seconds; a warm-up longer than that is itself the sample. A call that runs past `--limit` seconds is
stopped and reported as `>limit` (the ratio is then a lower bound). The meta build time clears the zigzag
index caches first, as a new microbatch would find them.

Meta is not CUDA: torch's SDPA on meta takes its math path (about 25 ops, forward and backward), where a CPU
or GPU dispatches one fused kernel; `fused_sdpa` puts it back to one fused op on both sides
(`--decomposed-sdpa` leaves it). Per op, meta is not CUDA's price either: many elementwise ops run Python
reference meta functions (slower than a CUDA launch), others are cheaper, and the old code's copies of
host-built masks and indices to the device (synchronising, from pageable memory) cost nothing here. So the
table also counts the aten ops one call dispatches (forward and backward, CPU ops of the old code's host
masks included): that count is what a GPU would launch or the host compute, whatever meta costs per op.

    python bench/attention_overhead.py [--quick] [--tokens 8192,32768,131072] [--groups 1,2,4,8]
        [--repeats 5] [--limit 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
BEFORE_REVISION = "457d665"
VARIANTS = ("allgather", "ring", "ulysses", "p2p")
LOCAL = "local"
"""The variant name of a one-rank group: only the one-rank path runs."""
HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
TOKENS, GROUPS = (8192, 32768, 131072), (1, 2, 4, 8)
QUICK_TOKENS, QUICK_GROUPS = (8192, 32768), (1, 4)


class CaseTimeout(Exception):
    """A call ran past the per-case limit."""


@dataclass
class Timing:
    """One layer's forward + backward on one side: median ms of the timed calls (None when stopped at the
    limit), every call's ms (the warm-up first), and the aten ops one call dispatches (None if not counted)."""

    ms: float | None
    calls_ms: list[float]
    timed_out: bool = False
    ops: int | None = None


@dataclass
class Row:
    """One case on one side: `timings` by kernel name ('before' for the old code; 'varlen', 'sdpa' after)."""

    tokens: int
    group: int
    variant: str
    samples: int
    timings: dict[str, Timing] = field(default_factory=dict)
    build_ms: float | None = None
    """Median `CPContext` construction (the per-microbatch `AttentionMeta.build`), after side only."""
    note: str = ""


def sample_lengths(total: int, seed: int = 0) -> tuple[int, ...]:
    """Long-tailed lengths summing to `total`: T/4, T/8, T/8, then uniform [64, 1024] (see the docstring)."""
    rng = random.Random(seed)
    lengths = [total // 4, total // 8, total // 8]
    rest = total - sum(lengths)
    while rest >= 64:
        n = min(rng.randint(64, 1024), rest)
        lengths.append(n)
        rest -= n
    lengths[-1] += rest
    assert sum(lengths) == total and min(lengths) > 0
    return tuple(lengths)


def cases(tokens: tuple[int, ...], groups: tuple[int, ...]) -> list[tuple[int, int, str]]:
    """(tokens, group size, variant) of every case: one `local` case per token count for a group of one."""
    return [(t, d, c) for t in tokens for d in groups for c in ((LOCAL,) if d == 1 else VARIANTS)]


# --- communication stubs -------------------------------------------------------------------------------------


class FakeGroup:
    """What the variants ask a process group: its size and this rank's place in it."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _Shift:
    """A ring shift that has arrived: `wait()` gives a tensor of the sent shape."""

    def __init__(self, x: torch.Tensor) -> None:
        self.received = torch.empty_like(x)

    def wait(self) -> torch.Tensor:
        return self.received


class _AllGather(torch.autograd.Function):
    """d x rows out, rows back: the shapes of the all-gather and its reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int) -> torch.Tensor:
        ctx.size = size
        return x.new_empty((size * x.shape[0], *x.shape[1:]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:])), None


class _AllToAll(torch.autograd.Function):
    """sum(recv) elements out, sum(send) back: the shapes of the all-to-all and its reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.send = send
        return x.new_empty(sum(recv))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.new_empty(sum(ctx.send)), None, None


def _start_shift(x: torch.Tensor, ring: object, tag: int = 0) -> _Shift:
    return _Shift(x)


def _all_gather(x: torch.Tensor, group: FakeGroup) -> torch.Tensor:
    return _AllGather.apply(x, group.size())


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: FakeGroup) -> torch.Tensor:
    return _AllToAll.apply(x, send, recv)


STUBS: dict[str, Callable] = {"start_shift": _start_shift, "all_gather": _all_gather, "all_to_all": _all_to_all}

_SDPA = torch.nn.functional.scaled_dot_product_attention


def fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention` on meta as one fused op, as on a CPU or GPU. On meta torch takes its
    math path instead (about 25 ops forward, their backward too), which would inflate every sdpa layer's
    dispatch; here the call dispatches what the CPU does: a boolean mask made additive, then the fused kernel."""
    if query.device.type != "meta" or kwargs or key.shape[-3] != query.shape[-3]:
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     **kwargs)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero, low = (torch.scalar_tensor(x, dtype=query.dtype, device=query.device) for x in (0.0, -math.inf))
        attn_mask = torch.where(attn_mask, zero, low)
    batched = query.dim() == 4
    q, k, v = (x if batched else x[None] for x in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                      attn_mask=attn_mask, scale=scale)[0]
    return out if batched else out[0]


@contextlib.contextmanager
def stubbed(fused: bool = True) -> Iterator[None]:
    """The collectives replaced by `STUBS` in `comm` and wherever a variant module imported them, and (`fused`)
    torch's SDPA by `fused_sdpa`; restored after (the test runs this in a process other tests share)."""
    from megatron_dhp.runtime.attention import allgather, comm, ring, ulysses

    saved = []
    for module in (comm, allgather, ring, ulysses):
        for name, stub in STUBS.items():
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, stub)
    if fused and has_meta_kernel("_scaled_dot_product_flash_attention_for_cpu"):
        saved.append((torch.nn.functional, "scaled_dot_product_attention", _SDPA))
        torch.nn.functional.scaled_dot_product_attention = fused_sdpa
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


# --- meta kernels --------------------------------------------------------------------------------------------


def has_meta_kernel(op: str) -> bool:
    """Whether `aten.<op>` has a kernel for the meta device on this torch."""
    packet = getattr(torch.ops.aten, op, None)
    return packet is not None and torch._C._dispatch_has_kernel_for_dispatch_key(packet.default.name(), "Meta")


def varlen_on_meta() -> bool:
    """Whether the `varlen` kernel can run on meta tensors (else the after side times `sdpa` in its place)."""
    return has_meta_kernel("_flash_attention_forward") and has_meta_kernel("_flash_attention_backward")


class _ShapeOnlyLseKernel:
    """The old ring's `LseKernel` as shapes only, where torch has no meta CPU flash kernel."""

    def forward(self, q, k, v, bias, scale):
        return q.new_empty(*q.shape[:2], v.shape[-1]), q.new_empty(q.shape[:2], dtype=torch.float32)

    def backward(self, grad, q, k, v, bias, out, lse, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def old_ring_kernel_note() -> str:
    """Substitute the old ring's CPU kernel if torch cannot run it on meta; what was done, or ''."""
    from megatron_dhp.runtime.attention import blocks

    ops = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
    if all(has_meta_kernel(op) for op in ops):
        return ""
    blocks.LSE_KERNELS["cpu"] = _ShapeOnlyLseKernel()
    return "old ring kernel shape-only (no meta CPU flash kernel)"


# --- timing --------------------------------------------------------------------------------------------------


def clock_of(wall: bool) -> Callable[[], float]:
    """Seconds on the bench's clock: the calling thread's CPU time, or wall time."""
    return time.perf_counter if wall else time.thread_time


@contextlib.contextmanager
def time_limit(seconds: float, wall: bool) -> Iterator[None]:
    """Raise `CaseTimeout` in this (main) thread once `seconds` pass on the process's CPU clock (user + system:
    with one intra-op thread, the worker's), or on the wall clock; off when 0 or off the main thread."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise CaseTimeout

    which, signum = (signal.ITIMER_REAL, signal.SIGALRM) if wall else (signal.ITIMER_PROF, signal.SIGPROF)
    previous = signal.signal(signum, expire)
    signal.setitimer(which, seconds)
    try:
        yield
    finally:
        signal.setitimer(which, 0)
        signal.signal(signum, previous)


def timed(call: Callable[[], None], repeats: int, budget_s: float, limit_s: float, wall: bool) -> Timing:
    """Median ms of `call` after one warm-up (see the docstring for the rule), and its aten ops when it is quick
    enough to count them once more (under a dispatch mode, not timed)."""
    clock = clock_of(wall)
    samples: list[float] = []
    try:
        for i in range(repeats + 1):
            with time_limit(limit_s, wall):
                start = clock()
                call()
                samples.append(clock() - start)
            if i == 0 and samples[0] > budget_s:
                break  # a slow warm-up is the sample: what it caches is small beside it
            if i > 0 and sum(samples[1:]) > budget_s:
                break
    except (CaseTimeout, RuntimeError) as error:  # a timeout raised inside the autograd engine may come wrapped
        if not isinstance(error, CaseTimeout) and "CaseTimeout" not in repr(error):
            raise
        return Timing(None, [x * 1e3 for x in samples], timed_out=True)
    timed_calls = samples[1:] or samples[:1]
    ops = count_ops(call) if max(timed_calls) < budget_s else None
    return Timing(statistics.median(timed_calls) * 1e3, [x * 1e3 for x in samples], ops=ops)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched below it, forward and backward (the autograd engine keeps the mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(call: Callable[[], None]) -> int:
    """aten ops one `call` dispatches: what a GPU launches or the host computes, independent of meta's speed."""
    with _OpCounter() as counter:
        call()
    return counter.ops


def qkv(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's q, k, v of one layer on the meta device (leaves that take gradients)."""
    shapes = ((rows, HEADS, HEAD_DIM), (rows, KV_HEADS, HEAD_DIM), (rows, KV_HEADS, HEAD_DIM))
    return tuple(torch.empty(s, dtype=DTYPE, device="meta", requires_grad=True) for s in shapes)


def fwd_bwd(layer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], rows: int
            ) -> Callable[[], None]:
    """One layer's forward and `out.backward(grad)` on fresh leaves' gradients."""
    q, k, v = qkv(rows)

    def call() -> None:
        for x in (q, k, v):
            x.grad = None
        out = layer(q, k, v)
        out.backward(torch.empty_like(out))

    return call


def group_of(comm: str, size: int, rank: int) -> object:
    """The group a `CPContext` takes: None for one rank, a `PeerRing` for p2p, else a `FakeGroup`."""
    from megatron_dhp.runtime.attention.comm import PeerRing

    if size == 1:
        return None
    return PeerRing(tuple(range(size)), rank, None) if comm == "p2p" else FakeGroup(size, rank)


def new_api() -> bool:
    """Whether the importable megatron_dhp has the per-microbatch metadata (the working tree) or not (457d665)."""
    return importlib.util.find_spec("megatron_dhp.runtime.attention.meta") is not None


def _clear_zigzag_caches() -> None:
    """Forget the zigzag index tables a previous build of the same lengths left, as a new microbatch would."""
    from megatron_dhp.runtime import fused

    for name in ("_device_sources", "_device_tables"):
        cached = getattr(fused, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


def measure_after(tokens: int, group: int, comm: str, args: argparse.Namespace) -> Row:
    """The working tree: metadata built once (timed apart), then each kernel's layer forward + backward."""
    from megatron_dhp.runtime.attention.context import CPContext
    from megatron_dhp.runtime.attention.core_attention import VARIANTS as FUNCTIONS
    from megatron_dhp.runtime.attention.kernels import kernel
    from megatron_dhp.runtime.attention.ulysses import no_heads
    from megatron_dhp.runtime.layout import MicrobatchLayout

    assert len(inspect.signature(FUNCTIONS["ring"]).parameters) == 6, "expected (q, k, v, ctx, kernel, scale)"
    lengths, rank, scale = sample_lengths(tokens, args.seed), group // 2, HEAD_DIM**-0.5
    row = Row(tokens, group, comm, len(lengths))
    varlen = "varlen" if varlen_on_meta() else "sdpa"
    if varlen != "varlen":
        row.note = "no meta flash kernel on this torch: 'after varlen' is sdpa"

    def context(backend: str) -> CPContext:
        layout = MicrobatchLayout(tuple(range(len(lengths))), lengths, group, rank)
        return CPContext(layout, group_of(comm, group, rank), "allgather" if comm == LOCAL else comm,
                         backend=backend, device="meta")

    context(varlen)  # first-use imports and caches outside every timing
    clock, builds = clock_of(args.wall), []
    for _ in range(max(3, args.repeats)):
        _clear_zigzag_caches()  # and a new layout: nothing of the previous build is reused
        start = clock()
        context(varlen)
        builds.append(clock() - start)
    row.build_ms = statistics.median(builds) * 1e3

    for name, kernel_name in (("varlen", varlen), ("sdpa", "sdpa")):
        ctx, local = context(kernel_name), kernel(kernel_name)
        if comm == LOCAL:  # what dynamic_cp_attention runs for a group of one rank, without its `resolve`
            def layer(q, k, v, ctx=ctx, local=local):
                return local.causal(q, k, v, ctx.meta.local, scale) if q.shape[1] else no_heads(q, k, v)
        else:
            def layer(q, k, v, ctx=ctx, local=local):
                return FUNCTIONS[comm](q, k, v, ctx, local, scale)
        row.timings[name] = timed(fwd_bwd(layer, ctx.layout.num_slots), args.repeats, args.budget, args.limit,
                                  args.wall)
    return row


def measure_before(tokens: int, group: int, comm: str, args: argparse.Namespace) -> Row:
    """Revision 457d665: `CPContext(layout, group, comm, 'auto')`, the variant (or the one-rank path) as it was."""
    from megatron_dhp.runtime.attention.context import CPContext
    from megatron_dhp.runtime.attention.core_attention import VARIANTS as FUNCTIONS
    from megatron_dhp.runtime.attention.core_attention import dynamic_cp_attention
    from megatron_dhp.runtime.layout import MicrobatchLayout

    assert len(inspect.signature(FUNCTIONS["ring"]).parameters) == 5, "expected (q, k, v, ctx, scale)"
    lengths, rank, scale = sample_lengths(tokens, args.seed), group // 2, HEAD_DIM**-0.5
    row = Row(tokens, group, comm, len(lengths), note=old_ring_kernel_note())
    layout = MicrobatchLayout(tuple(range(len(lengths))), lengths, group, rank)
    ctx = CPContext(layout, group_of(comm, group, rank), "allgather" if comm == LOCAL else comm, backend="auto")
    if comm == LOCAL:
        def layer(q, k, v):
            return dynamic_cp_attention(q, k, v, ctx, scale)
    else:
        def layer(q, k, v):
            return FUNCTIONS[comm](q, k, v, ctx, scale)
    row.timings["before"] = timed(fwd_bwd(layer, layout.num_slots), args.repeats, args.budget, args.limit, args.wall)
    return row


def measure_side(side: str, args: argparse.Namespace) -> list[Row]:
    """Every case of `args` on the importable revision, `side` naming which it must be."""
    assert new_api() == (side == "after"), f"--side {side} found the {'new' if new_api() else 'old'} attention API"
    measure = measure_after if side == "after" else measure_before
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows = []
    try:
        with stubbed(not args.decomposed_sdpa):
            for tokens, group, comm in cases(args.tokens, args.groups):
                row = measure(tokens, group, comm, args)
                print(f"[{side}] {tokens} tokens, group {group}, {comm}: "
                      + ", ".join(f"{k} {_ms(t)}" for k, t in row.timings.items()), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


# --- the before side in a worktree ---------------------------------------------------------------------------


def run_before(args: argparse.Namespace) -> list[Row]:
    """The before side in a subprocess on a temporary git worktree of `args.revision`, removed afterwards."""
    tmp = tempfile.mkdtemp(prefix="dhp-before-")
    tree, out = Path(tmp) / "tree", Path(tmp) / "before.json"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.revision], check=True,
                   capture_output=True)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, str(Path(__file__).resolve()), "--side", "before", "--json", str(out),
                   "--tokens", ",".join(map(str, args.tokens)), "--groups", ",".join(map(str, args.groups)),
                   "--repeats", str(args.repeats), "--budget", str(args.budget), "--limit", str(args.limit),
                   "--threads", str(args.threads), "--seed", str(args.seed), *(["--wall"] if args.wall else []),
                   *(["--decomposed-sdpa"] if args.decomposed_sdpa else [])]
        subprocess.run(command, check=True, env=env, cwd=tmp)
        return [row_from_dict(r) for r in json.loads(out.read_text())["rows"]]
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
        out.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.rmdir(tmp)


def row_from_dict(data: dict) -> Row:
    """A `Row` back from its JSON."""
    timings = {k: Timing(**t) for k, t in data.pop("timings").items()}
    return Row(**data, timings=timings)


# --- output --------------------------------------------------------------------------------------------------


def _ms(t: Timing | None) -> str:
    if t is None:
        return "-"
    return ">limit" if t.timed_out else f"{t.ms:.2f}"


def _ops(t: Timing | None) -> str:
    return "-" if t is None or t.ops is None else f"{t.ops:,}"


def ratio(before: Timing | None, after: Timing | None, limit_s: float) -> tuple[float | None, str]:
    """before / after, and its text: a lower bound (`>`) when before hit the limit."""
    if before is None or after is None or after.ms is None or after.ms <= 0:
        return None, "-"
    if before.timed_out:
        return None, f">{limit_s * 1e3 / after.ms:.0f}x"
    value = before.ms / after.ms
    return value, f"{value:.1f}x"


def merged(before: list[Row], after: list[Row], args: argparse.Namespace) -> list[dict]:
    """One record per case with both sides and the ratios."""
    by_case = {(r.tokens, r.group, r.variant): r for r in before}
    records = []
    for a in after:
        b = by_case.get((a.tokens, a.group, a.variant))
        old = b.timings.get("before") if b else None
        record = {"tokens": a.tokens, "group": a.group, "variant": a.variant, "samples": a.samples,
                  "before": asdict(old) if old else None, "after_varlen": asdict(a.timings["varlen"]),
                  "after_sdpa": asdict(a.timings["sdpa"]), "meta_build_ms": a.build_ms,
                  "notes": [n for n in (a.note, b.note if b else "") if n]}
        for name in ("varlen", "sdpa"):
            record[f"before_over_{name}"] = ratio(old, a.timings[name], args.limit)[0]
        records.append(record)
    return records


def print_table(before: list[Row], after: list[Row], args: argparse.Namespace) -> None:
    """The rich table of both sides."""
    from rich.console import Console
    from rich.table import Table

    by_case = {(r.tokens, r.group, r.variant): r for r in before}
    clock = "wall" if args.wall else "thread CPU"
    table = Table(title=f"host ms per attention layer, forward + backward, one rank ({clock} time, q/k/v on meta: "
                        f"{HEADS} q heads, {KV_HEADS} kv heads, dim {HEAD_DIM}, bf16)")
    for name in ("tokens", "group", "variant", "before ms", "after varlen ms", "after sdpa ms", "before / varlen",
                 "before / sdpa", "meta build ms", "aten ops before / varlen"):
        table.add_column(name, justify="left" if name == "variant" else "right")
    notes = set()
    for a in after:
        b = by_case.get((a.tokens, a.group, a.variant))
        old = b.timings.get("before") if b else None
        notes.update(n for n in (a.note, b.note if b else "") if n)
        table.add_row(f"{a.tokens // 1024}K", str(a.group), a.variant, _ms(old), _ms(a.timings["varlen"]),
                      _ms(a.timings["sdpa"]), ratio(old, a.timings["varlen"], args.limit)[1],
                      ratio(old, a.timings["sdpa"], args.limit)[1], f"{a.build_ms:.2f}",
                      f"{_ops(old)} / {_ops(a.timings['varlen'])}")
    console = Console()
    if not console.is_terminal and console.width < 160:  # a pipe or a file: room for every column
        console = Console(width=160)
    console.print(table)
    console.print(f"before = {args.revision} (backend auto -> sdpa, ring on blocks.chunks masks); after = working "
                  f"tree; the meta build runs once per microbatch, the layer once per layer. '>limit': a call ran past "
                  f"{args.limit:.0f} s. Median of up to {args.repeats} calls after a warm-up. aten ops: dispatched by one "
                  f"call, forward and backward ('-': not counted, a call over the {args.budget:g} s budget).")
    for note in sorted(notes):
        console.print(f"note: {note}")


def parse_ints(text: str) -> tuple[int, ...]:
    """`8192,32768` as (8192, 32768)."""
    return tuple(int(v) for v in text.split(","))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`--quick` already applied)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=parse_ints, default=TOKENS, help="microbatch tokens, comma-separated "
                        f"(default {','.join(map(str, TOKENS))})")
    parser.add_argument("--groups", type=parse_ints, default=GROUPS, help="group sizes, comma-separated "
                        f"(default {','.join(map(str, GROUPS))})")
    parser.add_argument("--quick", action="store_true", help=f"tokens {','.join(map(str, QUICK_TOKENS))}, groups "
                        f"{','.join(map(str, QUICK_GROUPS))}")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case after the warm-up (default 5)")
    parser.add_argument("--budget", type=float, default=2.0, help="stop repeating once a case's timed calls "
                        "reach this many seconds (default 2)")
    parser.add_argument("--limit", type=float, default=20.0, help="seconds before a call is stopped and reported "
                        "as >limit (default 20; 0: no limit)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--wall", action="store_true", help="wall time instead of the thread's CPU time")
    parser.add_argument("--decomposed-sdpa", action="store_true", help="leave torch's SDPA on meta as it is "
                        "(its math path, ~25 ops) instead of one fused op as on a CPU or GPU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the short sample lengths (default 0)")
    parser.add_argument("--revision", default=BEFORE_REVISION, help=f"the before revision (default {BEFORE_REVISION})")
    parser.add_argument("--side", choices=("both", "before", "after"), default="both",
                        help="both (default), or one side on the importable megatron_dhp (before: run with the "
                             "old revision on PYTHONPATH)")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.groups = QUICK_TOKENS, QUICK_GROUPS
    return args


def main() -> None:
    args = parse_args()
    if args.side != "both":
        rows = measure_side(args.side, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"side": args.side, "rows": [asdict(r) for r in rows]}, indent=2))
        return
    started = time.perf_counter()
    after = measure_side("after", args)
    before = run_before(args)
    print_table(before, after, args)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json",)}
        Path(args.json).write_text(json.dumps({"config": config, "cases": merged(before, after, args)}, indent=2))


if __name__ == "__main__":
    main()
