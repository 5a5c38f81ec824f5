"""What a paged cache refuses before it computes anything: a backend that cannot serve the call (dtype, values of
another head dim, a score modification), and ranks whose batches differ, told field by field. Small and fast:
the mutation pass of xcp/inference/paged.py leans on these (docs/testing.md)."""

from __future__ import annotations

import pytest
import torch
from helpers import installed

import xcp
from xcp.backends.cpu import CPUBackend
from xcp.comm import LocalWorld

H, HKV, D = 4, 2, 8


class _Narrow(CPUBackend):
    """The CPU kernels behind a backend that declares less: float64 alone, values of q's head dim alone, no
    score modifications (a third-party backend may be that narrow)."""

    name = "paged-narrow"
    dtypes = (torch.float64,)
    value_head_dims = False
    score_mods = ()


def _cache(dtype: torch.dtype, dv: int = D) -> xcp.PagedKVCache:
    cache = xcp.PagedKVCache(num_blocks=4, block_size=2, device=_Narrow.name)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, HKV, D, generator=g, dtype=dtype)
    cache.append(["a"], k, torch.randn(3, HKV, dv, generator=g, dtype=dtype), [0, 3])
    return cache


def test_a_paged_cache_refuses_what_its_backend_does_not_serve():
    """Each refusal names the argument and the backend; a call the backend serves runs (exact, against the
    CPU backend's own)."""
    with installed(_Narrow()):
        with pytest.raises(
            TypeError, match="^q: backend 'paged-narrow' serves dtypes torch.float64; got torch.float32"
        ):
            _cache(torch.float32).attention(torch.randn(1, H, D), ["a"], [0, 1])
        with pytest.raises(ValueError, match=r"^v: expected head dim 8 \(that of q: backend 'paged-narrow' does not"):
            _cache(torch.float64, dv=6).attention(torch.randn(1, H, D, dtype=torch.float64), ["a"], [0, 1])
        cache, q = _cache(torch.float64), torch.randn(2, H, D, dtype=torch.float64)
        with pytest.raises(NotImplementedError, match="^softcap: not supported by backend 'paged-narrow'"):
            cache.attention(q, ["a"], [0, 2], softcap=2.0)
        with pytest.raises(NotImplementedError, match="^alibi_slopes: not supported by backend 'paged-narrow'"):
            cache.attention(q, ["a"], [0, 2], alibi_slopes=torch.ones(H, dtype=torch.float64))
        served = cache.attention(q, ["a"], [0, 2])
    plain = xcp.PagedKVCache(num_blocks=4, block_size=2)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, HKV, D, generator=g, dtype=torch.float64)
    plain.append(["a"], k, torch.randn(3, HKV, D, generator=g, dtype=torch.float64), [0, 3])
    torch.testing.assert_close(served, plain.attention(q, ["a"], [0, 2]), atol=1e-12, rtol=0)


def _two_ranks(fn):
    with LocalWorld(2, timeout=20) as w:
        return w.run(fn)


def test_ranks_with_different_batches_are_told_which_field_differs_at_each_new_configuration():
    """The agreement compares the batch as [1, T, H, D] queries and the sequences' offsets and lengths, on the
    first call of each configuration (its key: the heads, dims, dtypes and options, never T): ranks that then
    switch together to another head count and pass different batches are refused again, naming q's shape."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(6, HKV, D, generator=g, dtype=torch.float64)
    q = torch.randn(6, H, D, generator=g, dtype=torch.float64)

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=8, block_size=2)
        cache.append(["a"], k[:4], k[:4], [0, 4])
        cache.attention(q[:2], ["a"], [0, 2])  # agreed: H = 4
        t = 1 if group.rank() == 0 else 2
        return cache.attention(q[4 - t : 4, : H // 2], ["a"], [0, t])  # a new key (H = 2), batches differ

    with pytest.raises(RuntimeError, match=r"q\.shape \(rank 0: \(1, 1, 2, 8\); rank 1: \(1, 2, 2, 8\)\)"):
        _two_ranks(rank)


def test_ranks_whose_caches_hold_different_lengths_are_told_the_keys_shapes():
    """A rank that appended a token more than its peer (appends must be the same on every rank) is refused at
    the next configuration's first call, naming the keys as [1, total length, Hkv, D] on each rank."""
    k = torch.randn(6, HKV, D, dtype=torch.float64)

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=8, block_size=2)
        n = 4 + group.rank()
        cache.append(["a"], k[:n], k[:n], [0, n])
        return cache.attention(torch.ones(1, H, D, dtype=torch.float64), ["a"], [0, 1])

    with pytest.raises(RuntimeError, match=r"k\.shape \(rank 0: \(1, 4, 2, 8\); rank 1: \(1, 5, 2, 8\)\)"):
        _two_ranks(rank)


def test_a_paged_in_place_whose_signature_cannot_be_read_is_not_asked_for_decode_calls():
    """reads_decode_in_place asks ``paged_in_place(..., max_q=1)`` only where the method takes ``max_q``; one whose
    signature Python cannot read (a builtin) counts as one written before ``max_q``: False, nothing called."""
    from xcp.inference.paged import reads_decode_in_place

    class Opaque(CPUBackend):
        name = "paged-opaque"
        paged_in_place = max  # a builtin: no readable signature (and calling it here would raise)

    pool = torch.zeros(2, 2, HKV, D)
    assert reads_decode_in_place(Opaque(), torch.zeros(1, H, D), pool, pool) is False
