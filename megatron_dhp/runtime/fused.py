"""The CUDA kernels of `csrc/` behind one call each, with a pure-torch fallback that gives the same result.

- `zigzag_pack` / `zigzag_unpack`: whole THD samples <-> one rank's (or every rank's) zigzag shards, the
  layout of `layout.zigzag_positions` (or, given each rank's chunks, of uneven shards, `layout.shard_positions`);
  the kernel derives each row's source from cu_seqlens, so no index tensor is built or copied to the device.
  It knows chunks equal on every rank only; uneven ones take the torch path, an index built once per
  microbatch.
- `gather_rows` / `scatter_rows`: rows by an int64 index, the re-dispatch primitive.
- `lse_merge`: `attention.math.merge_partials` as one kernel (and one for its backward).

A call takes the kernels when its tensor is on a CUDA device and they are available, loaded at a job's start-up
(`kernels_status`) or on first use: the library `MEGATRON_DHP_CSRC` names, else the one `scripts/build_csrc.sh`
builds by default (`PREBUILT`, one command, no GPU needed) while it is newer than every source, else built by
torch's JIT extension loader (cached under `TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`);
`MEGATRON_DHP_CSRC=0` turns them off, and a failed build warns once and falls back. Everything else, CPU
tensors above all, takes the torch path; nothing is compiled or loaded at import. Copies are bit-identical
on both paths; the torch `lse_merge` is `merge_partials` itself, which the kernel matches to float rounding.

Both paths share the autograd rules: pack and unpack are each other's adjoint, a scatter's gradient is a
gather, a gather's is an `index_add_` (repeated indices accumulate; this step stays in torch).
"""

from __future__ import annotations

import functools
import itertools
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention.math import merge_partials
from megatron_dhp.runtime.host import to_device
from megatron_dhp.runtime.layout import padded_length

_CSRC = Path(__file__).resolve().parents[2] / "csrc"
PREBUILT = _CSRC.parent / "build" / "csrc" / "libmegatron_dhp_csrc.so"
"""Where `scripts/build_csrc.sh` writes the library unless told otherwise."""
"""The kernel sources (present in a source checkout, which the JIT build needs)."""
_MERGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


Chunks = Sequence[Sequence[int]]
"""Each sample's chunk length on each group rank (`layout.MicrobatchLayout.chunks`): uneven shards."""


def zigzag_pack(
    x: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int], group_size: int, rank: int | None, pad_value: float = 0,
    *, chunks: Chunks | None = None,
) -> torch.Tensor:
    """Group rank `rank`'s zigzag shards of the whole samples in `x`: [T, ...] -> [sum_i padded_i / d, ...].

    Sample i is rows `cu_seqlens[i]:cu_seqlens[i+1]` of `x`; the result holds, sample by sample, the rows
    at `layout.zigzag_positions(L_i, group_size, rank)` (with `chunks`, at `layout.shard_positions` of the
    sample padded to twice their sum), padding rows set to `pad_value`. `rank=None` lays out every rank's
    shards one after another (rank-major: the order of an all-gather over the group). A `cu_seqlens` on the
    GPU costs a host sync; pass it on the CPU (or as a list).
    """
    return zigzag_on(cu_seqlens, group_size, rank, x.device, chunks=chunks).pack(x, pad_value)


def zigzag_unpack(
    shard: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int], group_size: int, rank: int | None,
    *, chunks: Chunks | None = None,
) -> torch.Tensor:
    """The inverse of `zigzag_pack`: every real shard row back to its place in [T, ...].

    Padding rows are ignored; rows of tokens that `rank` does not hold are 0 (with `rank=None` every
    token is restored, so `zigzag_unpack(zigzag_pack(x, cu, d, None), cu, d, None)` is `x`).
    """
    return zigzag_on(cu_seqlens, group_size, rank, shard.device, chunks=chunks).unpack(shard)


def zigzag_on(cu_seqlens: torch.Tensor | Sequence[int], group_size: int, rank: int | None,
              device: torch.device | str, *, chunks: Chunks | None = None) -> DeviceZigzag:
    """The zigzag layout of `zigzag_pack` with its index tables already on `device`: what a microbatch builds
    once (`attention.meta`) so that every layer packs and unpacks with no host work."""
    z = _Zigzag.of(cu_seqlens, group_size, rank, chunks)
    device = torch.device(device)
    if device.type == "cuda" and z.uniform and _load_kernels() is not None:
        return DeviceZigzag(z, tables=_device_tables(z.lengths, z.rows_of(z.ranks.start), device))
    return DeviceZigzag(z, sources=_device_sources(z, device))


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`out[i] = x[index[i]]` for an int64 index into dim 0; repeats allowed, every entry in range."""
    return _GatherRows.apply(x, _as_index(index, x))


def scatter_rows(x: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`out[index[i]] = x[i]` into `num_rows` rows; rows no index names are 0.

    Contract: the entries of `index` are distinct and in `[0, num_rows)`, so each output row is written
    at most once and the kernel needs no atomics. Range is checked (on the device for CUDA); repeats are
    not, and leave the row with one of the candidates, unspecified which.
    """
    index = _as_index(index, x)
    if index.numel() != x.shape[0]:
        raise DhpError(f"scatter_rows: index has {index.numel()} entries for {x.shape[0]} rows")
    return _ScatterRows.apply(x, index, num_rows)


def lse_merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """`merge_partials(outs, lses)` (per key block: out [t, h, dh], lse [t, h]) as one kernel where it applies.

    The kernel takes fp32/fp16/bf16 outputs with fp32 log-sum-exps, accumulates in fp32 and has a kernel
    backward; anything else, and every CPU tensor, goes to `merge_partials` itself.
    """
    ops = _kernels(outs[0])
    if ops is None or outs[0].dim() != 3 or outs[0].dtype not in _MERGE_DTYPES or lses[0].dtype != torch.float32:
        return merge_partials(list(outs), list(lses))
    return _LseMerge.apply(torch.stack(list(outs)), torch.stack(list(lses)))


@dataclass(frozen=True)
class _Zigzag:
    """A zigzag layout as the host knows it: sample lengths, group size, the ranks laid out in order, and each
    sample's chunk length on every rank."""

    lengths: tuple[int, ...]
    group_size: int
    ranks: range
    chunks: tuple[tuple[int, ...], ...]
    """c of each sample on each rank: equal ones (`padded_length` / 2d) unless given (d = 1: the sample)."""

    @staticmethod
    def of(cu_seqlens: torch.Tensor | Sequence[int], group_size: int, rank: int | None,
           chunks: Chunks | None = None) -> _Zigzag:
        cu = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise DhpError(f"cu_seqlens must start at 0 and never decrease, got {cu}")
        if group_size < 1:
            raise DhpError(f"group_size must be at least 1, got {group_size}")
        if rank is not None and not 0 <= rank < group_size:
            raise DhpError(f"rank {rank} is outside a group of {group_size}")
        ranks = range(group_size) if rank is None else range(rank, rank + 1)
        lengths = tuple(b - a for a, b in zip(cu, cu[1:]))
        if chunks is None:  # a group of one holds each sample whole, one "chunk" (`MicrobatchLayout.chunks`)
            chunks = [[n] if group_size == 1 else [padded_length(n, group_size) // (2 * group_size)] * group_size
                      for n in lengths]
        chunks = tuple(tuple(int(c) for c in per_rank) for per_rank in chunks)
        if len(chunks) != len(lengths) or any(len(c) != group_size or 2 * sum(c) < n for c, n in zip(chunks, lengths)):
            raise DhpError(f"chunks {chunks} must give each of the {len(lengths)} samples of lengths {lengths} one "
                           f"chunk per rank of {group_size}, their pairs holding the whole sample")
        return _Zigzag(lengths, group_size, ranks, chunks)

    @property
    def num_tokens(self) -> int:
        """Rows of the whole-sample tensor."""
        return sum(self.lengths)

    @property
    def uniform(self) -> bool:
        """Whether every rank holds the same chunks of each sample (what the kernels know)."""
        return all(len(set(c)) == 1 for c in self.chunks)

    def rows_of(self, rank: int) -> tuple[int, ...]:
        """Shard rows per sample on `rank`."""
        return self.lengths if self.group_size == 1 else tuple(2 * c[rank] for c in self.chunks)

    @functools.cached_property
    def rows(self) -> int:
        """Shard rows of the ranks laid out."""
        return sum(sum(self.rows_of(r)) for r in self.ranks)

    def sources(self) -> torch.Tensor:
        """The whole-tensor row each shard row holds, -1 for padding: the torch path's index (vectorised: each
        rank holds two runs of positions per sample, its front chunk from o_r = c_0 + ... + c_(r-1) and its
        mirror ending at 2 sum c - o_r)."""
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        starts = torch.cumsum(lengths, 0) - lengths
        if self.group_size == 1:
            return torch.arange(int(lengths.sum())).repeat(len(self.ranks))
        all_chunks = torch.tensor(self.chunks, dtype=torch.int64).reshape(len(self.lengths), self.group_size).T
        offsets = torch.cumsum(all_chunks, 0) - all_chunks  # o of every rank (rows) and sample (columns)
        ranks = torch.tensor(list(self.ranks), dtype=torch.int64)
        chunk, front = all_chunks[ranks], offsets[ranks]
        padded = 2 * all_chunks.sum(0)
        first = torch.stack((front, padded - front - chunk), dim=-1).reshape(-1)  # rank, sample, run
        runs = chunk.repeat_interleave(2, dim=1).reshape(-1)

        def per_row(x: torch.Tensor) -> torch.Tensor:
            return torch.repeat_interleave(x.expand(len(ranks), -1).repeat_interleave(2, dim=1).reshape(-1), runs)

        run_offsets = torch.cumsum(runs, 0) - runs
        positions = torch.arange(int(runs.sum())) + torch.repeat_interleave(first - run_offsets, runs)
        return torch.where(positions < per_row(lengths[None, :]), positions + per_row(starts[None, :]), -1)

    def kernel_args(self) -> tuple[int, int, int, int]:
        """(group size, first rank, ranks, rows per rank) as the kernels take them after the tables (uniform)."""
        return self.group_size, self.ranks.start, len(self.ranks), sum(self.rows_of(self.ranks.start))


@functools.lru_cache(maxsize=64)
def _device_tables(lengths: tuple[int, ...], local_lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 [2, n + 1] on `device`: sample starts in the whole tensor, then in one rank's shard (uniform).

    Cached: every layer of a microbatch uses the same layout, and a host-to-device copy stalls the host.
    """
    cums = [list(itertools.accumulate(v, initial=0)) for v in (lengths, local_lengths)]
    return to_device(torch.tensor(cums, dtype=torch.int64), device)


@functools.lru_cache(maxsize=64)
def _device_sources(z: _Zigzag, device: torch.device) -> torch.Tensor:
    """`z.sources()` on `device` for the torch path, cached like `_device_tables`: every layer of a microbatch
    packs and unpacks with the same layout, and the index is a host-to-device copy of O(tokens)."""
    return to_device(z.sources(), device)


@dataclass(frozen=True, eq=False)
class DeviceZigzag:
    """A zigzag layout and the device tensors its copies read: the kernels' sample tables, or the torch
    path's source index."""

    layout: _Zigzag
    tables: torch.Tensor | None = None
    sources: torch.Tensor | None = None

    def pack(self, x: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
        """`zigzag_pack` of whole samples `x`."""
        _check_rows(x, self.layout.num_tokens, "x", "the samples of cu_seqlens")
        return _ZigzagPack.apply(x, self, pad_value)

    def unpack(self, shard: torch.Tensor) -> torch.Tensor:
        """`zigzag_unpack` of shard rows `shard`."""
        z = self.layout
        _check_rows(shard, z.rows, "shard", f"the zigzag layout of {len(z.ranks)} rank(s)")
        return _ZigzagUnpack.apply(shard, self)


def _check_rows(x: torch.Tensor, rows: int, name: str, what: str) -> None:
    if x.dim() < 1 or x.shape[0] != rows:
        raise DhpError(f"{name} has shape {tuple(x.shape)} but {what} take {rows} rows")


def _as_index(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if index.dim() != 1 or x.dim() < 1:
        raise DhpError(f"need a 1-D index into the rows of x, got index {tuple(index.shape)}, x {tuple(x.shape)}")
    return index.to(device=x.device, dtype=torch.int64)


def kernels_status(device: torch.device) -> str:
    """Load (or build) the kernels now for `device` and say which copy kernels its steps run: called at start-up,
    so a JIT build does not stall the first forward and its outcome is on the start-up line."""
    if device.type != "cuda":
        return "copy kernels: torch (not a CUDA device)"
    start = time.perf_counter()
    if _load_kernels() is None:
        return "copy kernels: torch (the csrc kernels did not build or load; see the warning)"
    library = kernel_library()
    source = f"prebuilt {library}" if library is not None else "JIT-built"
    return f"copy kernels: csrc ({source}, {time.perf_counter() - start:.1f} s)"


def kernel_library() -> Path | None:
    """The compiled library a job loads: `MEGATRON_DHP_CSRC`'s, else `PREBUILT` while it is newer than every
    source under csrc/; None: build by JIT."""
    setting = os.environ.get("MEGATRON_DHP_CSRC", "")
    if setting:
        return Path(setting)
    if not PREBUILT.exists():
        return None
    newest = max((p.stat().st_mtime for p in _CSRC.glob("*") if p.suffix in (".cu", ".cpp", ".cuh", ".h")), default=0.0)
    return PREBUILT if PREBUILT.stat().st_mtime >= newest else None


def _kernels(t: torch.Tensor) -> Any | None:
    """The compiled operators when `t` is on CUDA and they are available, else None (the torch path)."""
    return _load_kernels() if t.is_cuda else None


@functools.cache
def _load_kernels() -> Any | None:
    if os.environ.get("MEGATRON_DHP_CSRC") == "0":
        return None
    try:
        library = kernel_library()
        if library is not None:
            torch.ops.load_library(str(library))
        else:
            from torch.utils.cpp_extension import load

            sources = sorted(_CSRC.glob("*.cu")) + [_CSRC / "binding.cpp"]
            load(
                name="megatron_dhp_csrc",
                sources=[str(s) for s in sources],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3"],
                is_python_module=False,
            )
    except Exception as e:  # no compiler, no sources (installed wheel), a failed build: the torch path is exact
        warnings.warn(f"megatron_dhp CUDA kernels unavailable, using the torch fallback: {e}", stacklevel=3)
        return None
    return torch.ops.megatron_dhp


def _pack(x: torch.Tensor, z: DeviceZigzag, pad_value: float) -> torch.Tensor:
    if z.tables is not None:
        return torch.ops.megatron_dhp.zigzag_pack(x, z.tables, *z.layout.kernel_args(), pad_value)
    src = z.sources
    out = x.index_select(0, src.clamp(min=0))
    return out.masked_fill_((src < 0).view(-1, *[1] * (x.dim() - 1)), pad_value)


def _unpack(shard: torch.Tensor, z: DeviceZigzag) -> torch.Tensor:
    if z.tables is not None:
        return torch.ops.megatron_dhp.zigzag_unpack(shard, z.tables, *z.layout.kernel_args(), z.layout.num_tokens)
    # padding rows (source -1) all land on one extra row, cut off after: no boolean index, no data-dependent shape
    src = torch.where(z.sources < 0, z.layout.num_tokens, z.sources)
    out = shard.new_zeros((z.layout.num_tokens + 1, *shard.shape[1:])).index_copy_(0, src, shard)
    return out[:-1]


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    ops = _kernels(x)
    return ops.gather_rows(x, index) if ops is not None else x.index_select(0, index)


def _scatter(x: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    ops = _kernels(x)
    if ops is not None:
        return ops.scatter_rows(x, index, num_rows)
    return x.new_zeros((num_rows, *x.shape[1:])).index_copy_(0, index, x)


class _ZigzagPack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, z: DeviceZigzag, pad_value: float) -> torch.Tensor:  # noqa: D102
        ctx.z = z
        return _pack(x, z, pad_value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        return _unpack(grad, ctx.z), None, None


class _ZigzagUnpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, z: DeviceZigzag) -> torch.Tensor:  # noqa: D102
        ctx.z = z
        return _unpack(shard, z)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return _pack(grad, ctx.z, 0), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        return _gather(x, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.num_rows, *grad.shape[1:])).index_add_(0, index, grad), None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(index)
        return _scatter(x, index, num_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        (index,) = ctx.saved_tensors
        return _gather(grad, index), None, None


class _LseMerge(torch.autograd.Function):
    """CUDA only: stacked outs [k, t, h, dh] and fp32 lses [k, t, h] -> [t, h, dh]."""

    @staticmethod
    def forward(ctx, outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(outs, lses)
        return torch.ops.megatron_dhp.lse_merge(outs, lses)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        outs, lses = ctx.saved_tensors
        grad_outs, grad_lses = torch.ops.megatron_dhp.lse_merge_backward(outs, lses, grad.contiguous())
        return grad_outs, grad_lses
