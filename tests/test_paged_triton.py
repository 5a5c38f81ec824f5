"""The CUDA backend's Triton paged decode (xcp_cuda/paged.py): which kernel a forward_paged call takes on the CPU
stand-in of tests/test_cuda_backend.py (with and without ``block_table`` in the flash op's schema), the split
plan, the settings; and the kernels themselves under Triton's interpreter against float64 (needs triton)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from test_cuda_backend import VARLEN_TOL, FakeAten, FakeAtenOfTorch211, _close, _cpu_backend, _paged_inputs

import xcp
from xcp_cuda import CUDABackend, kernels, paged

NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DECODES = [(1, 20, [1, 3]), (0, 5, [0]), (1, 0, []), (1, 7, [2])]  # (queries, keys, blocks): no query, no key too


def _backend(monkeypatch, aten, triton=True, **kwargs):
    """The CPU stand-in backend over ``aten`` (a flash op with or without block_table), triton importable or not."""
    backend, _ = _cpu_backend(monkeypatch, **{"triton_decode": "auto", **kwargs})
    monkeypatch.setattr(kernels, "ATEN", aten)
    monkeypatch.setattr(kernels, "triton_importable", lambda: triton)
    return backend


class _Recorder:
    """Stands in for paged.paged_decode: records its arguments, returns the base class's gather and math."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __call__(self, q, k_pool, v_pool, table, cu, used, max_k, scale, launch):
        self.calls.append((q.shape, k_pool.shape[1], max_k, scale, launch))
        return xcp.Backend.forward_paged(self.backend, q, k_pool, v_pool, table, cu, used, 1, max_k, scale)


# (block, aten with block_table, triton_decode, triton importable) -> the kernel of a decode call, of a chunk's call
CHOICES = [
    (256, True, "auto", True, "flash", "flash"),  # flash's paged form serves: it runs decode calls too
    (256, True, "triton", True, "triton", "flash"),
    (256, True, "off", True, "flash", "flash"),
    (16, True, "auto", True, "triton", "gather"),  # blocks of 16: flash's form refuses them
    (16, True, "off", True, "gather", "gather"),
    (256, False, "auto", True, "triton", "gather"),  # torch 2.11: no block_table
    (16, False, "auto", True, "triton", "gather"),
    (256, False, "auto", False, "gather", "gather"),  # no triton: the gather
]


@pytest.mark.parametrize("block,takes_table,mode,triton,decode,chunk", CHOICES)
def test_which_kernel_a_paged_call_takes(monkeypatch, block, takes_table, mode, triton, decode, chunk):
    """A decode call (max_q 1) takes flash's paged form where it serves (auto), else the Triton decode where triton
    is importable, else the gather; a chunk's call (max_q > 1) never takes the Triton decode. paged_in_place (every
    call in place) says flash's form alone. forward_paged runs the kernel named, with the backend's launcher."""
    aten = FakeAten() if takes_table else FakeAtenOfTorch211()
    backend = _backend(monkeypatch, aten, triton, triton_decode=mode)
    args, _ = _paged_inputs(block, 4, 2, DECODES, torch.bfloat16, seed=block)
    assert backend.paged_kernel(*args[:3], 1) == decode
    assert backend.paged_kernel(*args[:3], 2) == chunk
    assert backend.paged_in_place(*args[:3]) == (chunk == "flash")
    assert backend.paged_in_place(*args[:3], max_q=1) == (decode != "gather")
    assert backend.paged_in_place(*args[:3], max_q=2) == (chunk == "flash")
    recorder = _Recorder(backend)
    monkeypatch.setattr(paged, "paged_decode", recorder)
    out, lse = backend.forward_paged(*args, 1, 20, 0.3)
    assert recorder.calls == ([(args[0].shape, block, 20, 0.3, backend.launcher)] if decode == "triton" else [])
    assert [c[0] for c in aten.calls] == (["flash_paged_fwd"] if decode == "flash" else [])
    want = xcp.Backend.forward_paged(backend, *args, 1, 20, 0.3)
    _close("out", out, want[0], VARLEN_TOL[torch.bfloat16])
    _close("lse", lse, want[1], VARLEN_TOL[torch.bfloat16])


@pytest.mark.parametrize(
    "why,dtype,d,dv,h,hkv,capability",
    [
        ("float64", torch.float64, 16, 16, 4, 2, (9, 0)),
        ("head dim 512", torch.bfloat16, 512, 512, 4, 2, (9, 0)),
        ("values of another head dim", torch.bfloat16, 16, 8, 4, 2, (9, 0)),
        ("128 query heads per K/V head", torch.bfloat16, 16, 16, 128, 1, (9, 0)),
        ("an sm75 GPU", torch.float16, 16, 16, 4, 2, (7, 5)),
    ],
)
def test_the_triton_decode_leaves_what_it_does_not_serve_to_the_gather(monkeypatch, why, dtype, d, dv, h, hkv,
                                                                        capability):  # fmt: skip
    backend = _backend(monkeypatch, FakeAtenOfTorch211())
    monkeypatch.setattr(backend, "_capability", lambda device: capability)
    g = torch.Generator().manual_seed(d + h)
    q = torch.randn(2, h, d, generator=g).to(dtype)
    k_pool = torch.randn(3, 16, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(3, 16, hkv, dv, generator=g).to(dtype)
    assert backend.paged_kernel(q, k_pool, v_pool, 1) == "gather", why
    assert (paged.unsupported(q, k_pool, v_pool) is None) == (capability < (8, 0)), why


def test_the_split_plan_is_a_function_of_max_k_alone():
    """Splits of at least MIN_SPLIT keys, multiples of TILE, at most MAX_SPLITS, covering max_k; one for no key."""
    assert paged.decode_splits(0) == (1, paged.MIN_SPLIT)
    assert paged.decode_splits(1) == (1, paged.MIN_SPLIT)
    assert paged.decode_splits(paged.MIN_SPLIT + 1) == (2, paged.MIN_SPLIT)
    for max_k in (7, 512, 1300, 32768, 32769, 262144, 10**6 + 3):
        n, split = paged.decode_splits(max_k)
        assert split % paged.TILE == 0 and split >= paged.MIN_SPLIT and 1 <= n <= paged.MAX_SPLITS
        assert (n - 1) * split < max_k <= n * split


def test_the_triton_decode_setting_is_read_at_construction_and_checked(monkeypatch):
    monkeypatch.setenv("XCP_CUDA_TRITON_DECODE", "off")
    assert CUDABackend().triton_decode == "off" and CUDABackend(triton_decode="triton").triton_decode == "triton"
    monkeypatch.setenv("XCP_CUDA_TRITON_DECODE", "always")
    with pytest.raises(ValueError, match="XCP_CUDA_TRITON_DECODE: expected one of auto, triton, off; got 'always'"):
        CUDABackend()
    monkeypatch.delenv("XCP_CUDA_TRITON_DECODE")
    assert CUDABackend().triton_decode == "off"  # until the kernel has run on a GPU
    with pytest.raises(ValueError, match="triton_decode: expected one of auto, triton, off; got 'on'"):
        CUDABackend(triton_decode="on")


INTERPRETED = """
import math, random, numpy as np, torch
import triton.language as tl
from triton.runtime import interpreter

# Triton 3.6's interpreter with NumPy 2.4: a loop bound read from memory is a 1-element array, which int() no
# longer takes; and its dot multiplies bfloat16's raw bits (stored as uint16). Both mended here, in the
# interpreter only: a GPU's dot takes bfloat16 and sums in float32, as the widened operands do.
patch_tensor = interpreter._patch_lang_tensor
def mended_tensor(tensor, scope):
    patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = mended_tensor
dot = interpreter.InterpreterBuilder.create_dot
def widened(x):
    if x.dtype != tl.bfloat16:
        return x
    return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
interpreter.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, widened(a), widened(b), d, *rest)

import xcp
from xcp.kernels.math import math_forward_paged
from xcp_cuda import CUDABackend, paged

backend = CUDABackend(triton_decode="triton")
backend.device_type = "cpu"
backend._capability = lambda device: (9, 0)
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}  # relative, per row; lse: float32 sums
CASES = [  # block, H, Hkv, D, dtype, [(queries, keys)]
    (16, 4, 1, 64, torch.float32, [(1, 40), (0, 5), (1, 0), (1, 1300), (1, 16)]),
    (16, 8, 2, 128, torch.bfloat16, [(1, 1100), (1, 3), (0, 0), (1, 0), (1, 513)]),
    (256, 4, 4, 128, torch.bfloat16, [(1, 300), (1, 0), (1, 1200), (0, 70)]),
    (256, 8, 2, 64, torch.float32, [(1, 257), (1, 1), (1, 600)]),
    (16, 4, 4, 64, torch.bfloat16, [(1, 31)]),
    (16, 2, 2, 256, torch.float16, [(1, 100), (1, 40)]),  # head dim 256: half the keys a tile
]
random.seed(0)
for case, (block, h, hkv, d, dtype, segments) in enumerate(CASES):
    g = torch.Generator().manual_seed(case)
    need = [-(-keys // block) for _, keys in segments]
    n = sum(need) + 2  # two blocks no segment lists: a kernel reading past a length mixes them in
    order = list(range(n))
    random.shuffle(order)  # the table shuffled: blocks out of order
    width = max(need) + 1  # room for max_k above the longest
    table = torch.full((len(segments), width), order[-1], dtype=torch.int32)
    at = 0
    for i, count in enumerate(need):
        table[i, :count] = torch.tensor(order[at : at + count], dtype=torch.int32)
        at += count
    t = sum(nq for nq, _ in segments)
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64).to(dtype)
    k_pool, v_pool = (torch.randn(n, block, hkv, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    cu = torch.tensor([0] + [sum(nq for nq, _ in segments[: i + 1]) for i in range(len(segments))], dtype=torch.int32)
    used = torch.tensor([keys for _, keys in segments], dtype=torch.int32)
    max_k = max(keys for _, keys in segments) + 5  # a bound, not the longest
    args = (q, k_pool, v_pool, table, cu, used)
    before = [x.clone() for x in args]
    assert backend.paged_kernel(q, k_pool, v_pool, 1) == "triton"
    for causal in (False, True):
        out, lse = backend.forward_paged(*args, 1, max_k, 0.3, causal)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == (h, t) and lse.dtype == torch.float32
        assert not out.isnan().any() and not lse.isnan().any()
        want_out, want_lse = math_forward_paged(q.double(), k_pool.double(), v_pool.double(), table, cu, used, 1,
                                                max_k, 0.3, causal)
        blind = torch.isinf(want_lse)
        assert torch.equal(torch.isinf(lse), blind) and (lse[blind] < 0).all(), (case, causal)
        assert torch.equal(out.transpose(0, 1)[blind], torch.zeros_like(out.transpose(0, 1)[blind]))
        seen = ~blind.transpose(0, 1)  # [T, H]: each row against its own size (long segments' outs are small)
        err = ((out.double() - want_out).norm(dim=-1)[seen] / want_out.norm(dim=-1)[seen]).max().item()
        assert err < TOL[dtype], (case, causal, err)
        assert (lse.double() - want_lse)[~blind].abs().max().item() < 1e-4, (case, causal)
        gathered = xcp.Backend.forward_paged(backend, *args, 1, max_k, 0.3, causal)
        assert (out.double() - gathered[0].double()).abs().max().item() <= 2 * TOL[dtype] * want_out.abs().max().item()
    assert paged.decode_splits(max_k)[0] == (3 if max_k > 1024 else 2 if max_k > 512 else 1)
    for x, y in zip(args, before):
        assert torch.equal(x, y)
strided = table.t().contiguous().t()  # a table whose rows are not contiguous: read as its values say
assert not strided.is_contiguous()
got, want = (paged.paged_decode(q, k_pool, v_pool, x, cu, used, max_k, 0.3) for x in (strided, table))
assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
empty = paged.paged_decode(q[:0], k_pool, v_pool, table[:0], cu[:1], used[:0], 0, 0.3)
assert empty[0].shape == (0, q.shape[1], q.shape[2]) and empty[1].shape == (q.shape[1], 0)
print("interpreted ok")
"""


@NEEDS_TRITON
def test_the_triton_paged_decode_under_tritons_interpreter_equals_float64():
    """The two kernels run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1, in a fresh process) through
    CUDABackend.forward_paged, causal and not, against float64 attention over each segment's gathered rows and the
    base class's gather: blocks of 16 and 256 rows, GQA groups 1 to 4, head dims 64, 128 and 256, bfloat16, float16
    and float32,
    tables shuffled, lengths not multiples of the block, 1 to 3 splits (segments filling fewer than the call has,
    one exactly a split's keys + 1), a segment without keys (out 0, lse -inf, no NaN), segments without a query,
    max_k above the longest; inputs untouched; a table of strided rows; an empty batch."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "interpreted ok" in run.stdout, run.stdout + run.stderr
