"""The CUDA kernels against the torch path: bit-identical copies, the merge to float rounding (GPU only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dhp.runtime import fused
from megatron_dhp.runtime.attention.math import block_attention, merge_partials, visible
from megatron_dhp.runtime.fused import gather_rows, lse_merge, scatter_rows, zigzag_pack, zigzag_unpack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Fail, rather than compare the torch path with itself, when the kernels do not build."""
    ops = fused._load_kernels()
    assert ops is not None, "the CUDA kernels did not build or load (see the warning)"
    return ops


def rows(num_rows, dtype, width, seed=0):
    """Random rows of any dtype, through raw bytes so that every bit pattern (NaN payloads too) appears."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_rows, *width, itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).view(num_rows, *width) if dtype != torch.bool else raw[..., 0] % 2 == 1


# row sizes of 1, 2, 3, 4, 6, 8, 16, 512 bytes: every vector width, and widths that force narrow ones
LAYOUTS = [
    (torch.uint8, (1,)), (torch.uint8, (3,)), (torch.int16, (1,)), (torch.float16, (3,)), (torch.float32, (1,)),
    (torch.int64, ()), (torch.bfloat16, (8,)), (torch.bool, (16,)), (torch.float32, (4, 32)),
]
SAMPLES = [([10, 1, 33, 0, 7], 3), ([64, 5], 5), ([13, 13, 40], 6), ([100], 7), ([8, 9], 1), ([3, 70, 2], 2)]


def bits(t):
    """An integer view of the same bytes: equality is then bit equality, NaN payloads included."""
    if t.dtype == torch.bool:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype,width", LAYOUTS)
@pytest.mark.parametrize("lengths,d", SAMPLES)
def test_pack_and_unpack_are_bit_identical(dtype, width, lengths, d):
    x = rows(sum(lengths), dtype, width)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    pad = True if dtype == torch.bool else 3
    for rank in [*range(d), None]:
        want = zigzag_pack(x, cu, d, rank, pad)
        got = zigzag_pack(x.cuda(), cu, d, rank, pad)
        assert torch.equal(bits(got.cpu()), bits(want)), (rank, dtype, width)
        assert torch.equal(bits(zigzag_unpack(got, cu, d, rank).cpu()), bits(zigzag_unpack(want, cu, d, rank)))


@pytest.mark.parametrize("dtype,width", LAYOUTS)
def test_gather_and_scatter_are_bit_identical(dtype, width):
    x = rows(1000, dtype, width, seed=1)
    gen = torch.Generator().manual_seed(2)
    index = torch.randint(0, 1000, (2500,), generator=gen)
    assert torch.equal(bits(gather_rows(x.cuda(), index.cuda()).cpu()), bits(gather_rows(x, index)))
    perm = torch.randperm(1300, generator=gen)[:1000]
    assert torch.equal(bits(scatter_rows(x.cuda(), perm.cuda(), 1300).cpu()), bits(scatter_rows(x, perm, 1300)))


def test_misaligned_and_strided_inputs():
    base = rows(4001, torch.uint8, (12,), seed=3)
    x = base[1:]  # rows of 12 bytes starting 12 bytes in: 4-byte vectors at most
    index = torch.arange(3999, -1, -1)
    assert torch.equal(gather_rows(x.cuda(), index.cuda()).cpu(), gather_rows(x, index))
    strided = rows(500, torch.float32, (6,), seed=4)[:, ::2]
    got = zigzag_pack(strided.cuda(), [0, 200, 500], 4, 1).cpu()
    assert torch.equal(bits(got), bits(zigzag_pack(strided, [0, 200, 500], 4, 1)))


def test_more_work_than_one_grid_covers():
    """More 4-byte rows than 65535 blocks x 256 threads: the grid-stride loops must cover the rest."""
    n = 17_500_000
    x = torch.arange(n, dtype=torch.int32, device="cuda").view(n, 1)
    index = torch.arange(n - 1, -1, -1, device="cuda")
    assert torch.equal(gather_rows(x, index), x.flip(0))
    assert torch.equal(scatter_rows(x, index, n), x.flip(0))
    packed = zigzag_pack(x, [0, n], 2, None)
    assert torch.equal(zigzag_unpack(packed, [0, n], 2, None), x)


def test_copy_gradients_match_the_torch_path():
    lengths, d = [21, 4, 9], 3
    x = torch.randn(sum(lengths), 5, dtype=torch.float64)
    grads = {}
    for device in ("cpu", "cuda"):
        leaf = x.to(device).requires_grad_()
        shard = zigzag_pack(leaf, [0, 21, 25, 34], d, 1, 9.0)
        out = scatter_rows(gather_rows(shard, torch.tensor([0, 3, 3, 1])), torch.tensor([2, 0, 1, 4]), 6)
        full = zigzag_unpack(zigzag_pack(out.sum(1, keepdim=True) * leaf[:6, :1], [0, 6], 2, None), [0, 6], 2, None)
        (grad,) = torch.autograd.grad(full.square().sum(), leaf)
        grads[device] = grad.cpu()
    torch.testing.assert_close(grads["cuda"], grads["cpu"], rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,dim", [(1, 64), (3, 128), (7, 200), (4, 16)])
def test_lse_merge_matches_merge_partials(dtype, k, dim):
    gen = torch.Generator().manual_seed(k * dim)
    outs = [torch.randn(37, 4, dim, generator=gen).to(dtype).cuda().requires_grad_() for _ in range(k)]
    lses = [(torch.randn(37, 4, generator=gen) * 5).cuda().requires_grad_() for _ in range(k)]
    if k > 1:
        with torch.no_grad():
            lses[1][::3] = -1.0e30  # blocks a query cannot see
    got, want = lse_merge(outs, lses), merge_partials(outs, lses)
    assert got.dtype == dtype and got.grad_fn is not None and "LseMerge" in type(got.grad_fn).__name__
    tol = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}[dtype]
    torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1])
    g = torch.randn(got.shape, generator=gen).to(dtype).cuda()
    leaves = outs + lses
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        # lse gradients are differences of fp32 dot products over dh: allow their rounding
        torch.testing.assert_close(a.float(), b.float(), rtol=tol[0], atol=1e-4)


def test_ring_style_merge_equals_full_attention():
    gen = torch.Generator().manual_seed(5)
    pos = torch.cat([torch.arange(40), torch.arange(24)])
    seg = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(24, dtype=torch.long)])
    q, k, v = (torch.randn(64, 4, 32, generator=gen).cuda() for _ in range(3))
    pos, seg = pos.cuda(), seg.cuda()
    full, _ = block_attention(q, k, v, visible(pos, pos, seg, seg), 0.2)
    blocks = [torch.arange(i, 64, 3, device="cuda") for i in range(3)]
    parts = [block_attention(q, k[b], v[b], visible(pos, pos[b], seg, seg[b]), 0.2) for b in blocks]
    merged = lse_merge([o for o, _ in parts], [lse for _, lse in parts])
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)


def test_out_of_range_index_is_a_device_assert():
    """Checked in a child process: a device-side assert poisons the CUDA context it happens in."""
    code = (
        "import torch; from megatron_dhp.runtime.fused import gather_rows\n"
        "gather_rows(torch.zeros(4, 2, device='cuda'), torch.tensor([1, 4], device='cuda')); torch.cuda.synchronize()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode != 0 and "assert" in proc.stderr.lower(), proc.stderr[-2000:]
