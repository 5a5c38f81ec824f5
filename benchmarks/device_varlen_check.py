"""Check the CUDA backend's packed-documents path on a GPU: forward_varlen / backward_varlen (one aten flash
varlen call for all segments) against a float64 reference in bf16 and fp16, and its time against the base
class's one dense call per segment. Prints a table; exits 1 if a check fails, 2 without a usable GPU.

    PYTHONPATH=. python3 benchmarks/device_varlen_check.py

Needs an sm80+ GPU (flash) and about 40 GiB of its memory for the float64 reference of the 4 x 16K layout;
well under a minute on an H200.
"""

from __future__ import annotations

import math
import random
import sys
import time

import torch

import xcp
from xcp_cuda import CUDABackend

# Largest error allowed, as a fraction of max(1, max |reference|), by dtype: the device tests' tolerances
# (tests/test_device_backends.py). bf16 keeps 8 bits (eps 3.9e-3) and flash rounds P to bf16 before P.V;
# fp16 keeps 11 (eps 4.9e-4); gradients sum O(S) such terms, hence about twice the output's. lse is fp32
# sums of exact products of the rounded inputs.
TOL = {
    torch.bfloat16: {"out": 2e-2, "lse": 1e-3, "grad": 4e-2},
    torch.float16: {"out": 3e-3, "lse": 1e-3, "grad": 6e-3},
}


def cumulative(lengths: list[int]) -> tuple[int, ...]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def short_documents(total: int, seed: int) -> tuple[int, ...]:
    """Documents of 1 to 300 tokens (a few of exactly 1) filling ``total`` tokens."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(1 if rng.random() < 0.1 else rng.randint(2, 300))
    lengths[-1] -= sum(lengths) - total
    return cumulative([n for n in lengths if n > 0])


# name, cu_q, cu_k, causal, heads, kv heads, head_dim, gqa mode
LAYOUTS = [
    ("4 docs x 16K, causal, GQA 32/8", cumulative([16384] * 4), None, True, 32, 8, 128, "native"),
    ("uneven, full, GQA 32/8", (0, 1, 1000, 1001, 5000), (0, 3, 2000, 2001, 4500), False, 32, 8, 128, "native"),
    ("uneven, full, GQA 32/8 repeat", (0, 1, 1000, 1001, 5000), (0, 3, 2000, 2001, 4500), False, 32, 8, 128, "repeat"),
    ("short docs (8K), causal, MHA 16", short_documents(8192, 1), None, True, 16, 16, 64, "native"),
    ("3 docs, causal, MQA 8/1, D=256", (0, 1, 3001, 4096), None, True, 8, 1, 256, "native"),
]


def reference(q, k, v, dout, cu_q, cu_k, causal: bool, scale: float):
    """float64 on the GPU, one (segment, KV head) at a time: out [T, H, D], lse [H, T], and dq, dk, dv of
    sum(out * dout) computed from out rounded to q's dtype (what the backward is given, as in the ring)."""
    q64, k64, v64, do64 = (x[0].double() for x in (q, k, v, dout))
    hkv = k64.shape[1]
    g = q64.shape[1] // hkv
    out, dq = torch.empty_like(q64), torch.empty_like(q64)
    dk, dv = torch.empty_like(k64), torch.empty_like(v64)
    lse = torch.empty(q64.shape[1], q64.shape[0], dtype=torch.float64, device=q.device)
    for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        above = torch.ones(b - a, d - c, dtype=torch.bool, device=q.device).triu(1) if causal else None
        for j in range(hkv):
            hs = slice(j * g, (j + 1) * g)
            qs, dos = (x[a:b, hs].transpose(0, 1) for x in (q64, do64))  # [G, n, D]
            ks, vs = k64[c:d, j], v64[c:d, j]  # [m, D]
            s = (qs @ ks.T).mul_(scale)
            if above is not None:
                s.masked_fill_(above, -math.inf)
            lse_s = torch.logsumexp(s, -1)
            p = s.sub_(lse_s.unsqueeze(-1)).exp_()
            o = p @ vs
            out[a:b, hs] = o.transpose(0, 1)
            lse[hs, a:b] = lse_s
            dv[c:d, j] = (p.transpose(1, 2) @ dos).sum(0)
            delta = (dos * o.to(q.dtype).double()).sum(-1, keepdim=True)
            ds = p.mul_((dos @ vs.T).sub_(delta))
            dq[a:b, hs] = (ds @ ks).mul_(scale).transpose(0, 1)
            dk[c:d, j] = (ds.transpose(1, 2) @ qs).sum(0).mul_(scale)
            del s, p, ds
    return out, lse, dq, dk, dv


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|); inf when got has NaN or inf."""
    got = got.double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).abs().max() / max(1.0, want.abs().max().item())).item()


def timed(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of ``fn`` on the current stream, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check(name, cu_q, cu_k, causal, h, hkv, d, gqa, dtype, dev) -> tuple[bool, list[str]]:
    cu_k = cu_q if cu_k is None else cu_k
    backend = CUDABackend(gqa=gqa)
    scale = 1 / math.sqrt(d)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(t: int, heads: int) -> torch.Tensor:
        return torch.randn(1, t, heads, d, generator=gen, device=dev).to(dtype)

    q, k, v, dout = rnd(cu_q[-1], h), rnd(cu_k[-1], hkv), rnd(cu_k[-1], hkv), rnd(cu_q[-1], h)
    fast = backend.varlen_kernel(q, cu_q, cu_k)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, scale)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, cu_q, cu_k, causal, scale)
    given_out, given_lse = ref_out.to(dtype).unsqueeze(0), ref_lse.float().unsqueeze(0)
    grads = backend.backward_varlen(dout, q, k, v, given_out, given_lse, cu_q, cu_k, causal, scale)
    torch.cuda.synchronize()
    errors = {
        "out": error(out[0], ref_out),
        "lse": error(lse[0], ref_lse),
        **{n: error(g[0], r) for n, g, r in zip(("dq", "dk", "dv"), grads, (ref_dq, ref_dk, ref_dv))},
    }
    shapes_ok = out.shape == q.shape and lse.shape == (1, h, cu_q[-1]) and lse.dtype == torch.float32
    shapes_ok &= all(g.shape == x.shape and g.dtype == dtype for g, x in zip(grads, (q, k, v)))
    tol = TOL[dtype]
    ok = fast and shapes_ok and all(e <= tol["grad" if n.startswith("d") else n] for n, e in errors.items())
    del ref_out, ref_lse, ref_dq, ref_dk, ref_dv, given_out, given_lse

    def varlen_step():
        o, s = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, scale)
        backend.backward_varlen(dout, q, k, v, o, s, cu_q, cu_k, causal, scale)

    def per_segment_step():
        o, s = xcp.Backend.forward_varlen(backend, q, k, v, cu_q, cu_k, causal, scale)
        xcp.Backend.backward_varlen(backend, dout, q, k, v, o, s, cu_q, cu_k, causal, scale)

    t_fast, t_loop = timed(varlen_step), timed(per_segment_step)
    row = [
        name,
        str(dtype).removeprefix("torch."),
        str(len(cu_q) - 1),
        "varlen" if fast else "LOOP",
        *(f"{errors[n]:.1e}" for n in ("out", "lse", "dq", "dk", "dv")),
        f"{tol['out']:g}/{tol['lse']:g}/{tol['grad']:g}",
        f"{t_fast:.2f}",
        f"{t_loop:.2f}",
        "ok" if ok else ("FAIL" if shapes_ok else "FAIL (shape/dtype)"),
    ]
    return ok, row


def main() -> int:
    ok, reason = CUDABackend().available()
    if not ok:
        print(f"device_varlen_check: {reason}", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(dev)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, sm{major}{minor}")
    header = ["layout", "dtype", "docs", "path", "out", "lse", "dq", "dk", "dv", "tol o/lse/grad", "varlen ms"]
    header += ["per-doc ms", ""]
    rows, failed, started = [], 0, time.perf_counter()
    for layout in LAYOUTS:
        for dtype in (torch.bfloat16, torch.float16):
            try:
                good, row = check(*layout, dtype, dev)
            except Exception as exc:  # noqa: BLE001 - report the layout and go on with the others
                error_text = f"FAIL {type(exc).__name__}: {str(exc)[:200]}"
                good, row = False, [layout[0], str(dtype).removeprefix("torch."), "", "", error_text]
            failed += not good
            rows.append(row)
            torch.cuda.empty_cache()
    widths = [max(len(r[i]) for r in [header, *rows] if i < len(r)) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print("errors: max |got - ref| / max(1, max |ref|) against float64; ms: forward + backward, median of 5")
    print(f"{len(rows) - failed}/{len(rows)} checks passed in {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
