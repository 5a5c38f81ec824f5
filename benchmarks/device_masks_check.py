"""Check the ring with packed documents, sliding windows and sinks on a GPU, and torch.compile there.

Virtual ranks (LocalWorld threads) on one device drive xcp.ring_forward / xcp.ring_backward directly (on
a GPU autograd runs every thread's backward on one worker, see docs/architecture.md); the sinks' gradient
comes from xcp.kernels.merge.sinks_grad as the autograd formula computes it. Each case is compared with a
float64 softmax over the whole sequence with the explicit mask (documents, causal, band, sink logit).
Then torch.compile(fullgraph=True, inductor) of a world of one against eager. Prints a table; exits 1 on
a failed check, 2 without a GPU.

    PYTHONPATH=. python3 benchmarks/device_masks_check.py
"""

from __future__ import annotations

import bisect
import sys

import torch

import xcp
from xcp.kernels.merge import sinks_grad
from xcp.ring import RingConfig, ring_backward, ring_forward

# fraction of max(1, max |reference|): bf16 keeps 8 bits and flash rounds P to bf16 (out ~1e-2), gradients
# sum S such terms (2x); fp16 keeps 11 bits
TOL = {torch.bfloat16: (2e-2, 4e-2), torch.float16: (3e-3, 6e-3)}


def reference(q, k, v, dout, sinks, cu, causal, window):
    s = q.shape[1]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    q64, k64, v64, s64 = leaves
    doc = torch.tensor([bisect.bisect_right(cu, i) - 1 for i in range(s)], device=q.device)
    i, j = torch.arange(s, device=q.device).unsqueeze(1), torch.arange(s, device=q.device).unsqueeze(0)
    allowed = doc.unsqueeze(1) == doc.unsqueeze(0)
    if causal:
        allowed &= j <= i
    if window is not None:
        if window[0] is not None:
            allowed &= j >= i - window[0]
        if window[1] is not None:
            allowed &= j <= i + window[1]
    g = q.shape[2] // k.shape[2]
    qh = q64.transpose(1, 2)
    kh = k64.transpose(1, 2).repeat_interleave(g, 1)
    vh = v64.transpose(1, 2).repeat_interleave(g, 1)
    scores = (qh @ kh.transpose(-1, -2) * q.shape[3] ** -0.5).masked_fill(~allowed, float("-inf"))
    scores = torch.cat([scores, s64.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    vh = torch.cat([vh, torch.zeros_like(vh[:, :, :1])], 2)
    out = (scores.softmax(-1) @ vh).transpose(1, 2)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return [out.detach(), *grads]


def ring(q, k, v, dout, sinks, cu, causal, window, world, balance):
    def rank_fn(group):
        r = group.rank()
        local = [xcp.shard(x, world, r, balance=balance) for x in (q, k, v, dout)]
        docs = tuple(cu) if (len(cu) > 2 or window is not None) else None
        cfg = RingConfig(group, xcp.get_backend(q.device.type), causal, q.shape[3] ** -0.5, balance, documents=docs,
                         window=xcp.documents.check_window(window, causal))  # fmt: skip
        out, lse = ring_forward(*local[:3], cfg, sinks)
        grads = ring_backward(local[3], *local[:3], out, lse, cfg)
        return [out, *grads, sinks_grad(local[3], out, lse, sinks)]

    per_rank = xcp.LocalWorld(world, device=q.device, timeout=120).run(rank_fn)
    got = [xcp.unshard([res[i] for res in per_rank], balance=balance) for i in range(4)]
    return got + [sum(res[4] for res in per_rank)]


def err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and len(sys.argv) < 2:
        print("needs a CUDA GPU (or a scale-down factor for a dry run on the CPU: device_masks_check.py 32)")
        return 2
    scale = int(sys.argv[1]) if len(sys.argv) > 1 else 1  # a dry run on the CPU: S / scale (see main)
    cases = [  # name, S, world, balance, causal, document lengths as shares of S (a 1-token first), window
        ("docs zigzag causal", 8192, 4, "zigzag", True, [0.09, 0.37, 0.01, 0.3], None),
        ("docs stripe causal", 4096, 4, "stripe", True, [0.29, 0.22], None),
        ("docs contiguous full", 8192, 4, "contiguous", False, [0.61], None),
        ("window 512 contiguous causal", 8192, 8, "contiguous", True, None, (512, 0)),
        ("window 300 zigzag causal + docs", 8192, 4, "zigzag", True, [0.49], (300, 0)),
        ("window 200/100 contiguous full", 8192, 4, "contiguous", False, None, (200, 100)),
    ]
    failed = 0
    print(f"{'case':36} {'dtype':9} {'out':>8} {'dq':>8} {'dk':>8} {'dv':>8} {'dsinks':>8}  check")
    for name, s, world, balance, causal, shares, window in cases:
        s //= scale
        window = None if window is None else tuple(None if w is None else (w and max(w // scale, 1)) for w in window)
        cu = [0]
        if shares is not None:  # a document of 1 token, then the shares, the last one filling S
            cu.append(1)
            for share in shares:
                cu.append(cu[-1] + max(int(share * s), 1))
        cu.append(s)
        for dtype in (torch.bfloat16, torch.float16):
            gen = torch.Generator(device=dev).manual_seed(1)
            q, dout = (torch.randn(1, s, 16, 128, generator=gen, device=dev, dtype=dtype) for _ in range(2))
            k, v = (torch.randn(1, s, 4, 128, generator=gen, device=dev, dtype=dtype) for _ in range(2))
            sinks = torch.randn(16, generator=gen, device=dev, dtype=torch.float32)
            got = ring(q, k, v, dout, sinks, cu, causal, window, world, balance)
            want = reference(q, k, v, dout, sinks, cu, causal, window)
            errors = [err(g, w) for g, w in zip(got, want)]
            tol_out, tol_grad = TOL[dtype]
            ok = errors[0] <= tol_out and all(e <= tol_grad for e in errors[1:])
            failed += not ok
            cells = " ".join(f"{e:8.1e}" for e in errors)
            print(f"{name:36} {str(dtype)[6:]:9} {cells}  {'ok' if ok else 'FAIL'}", flush=True)
    # torch.compile, inductor, a world of one on the GPU
    torch._dynamo.reset()
    gen = torch.Generator(device=dev).manual_seed(2)
    s = 4096 // scale
    q = torch.randn(1, s, 32, 128, generator=gen, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, s, 8, 128, generator=gen, device=dev, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip

    def fn(q, k, v):
        return xcp.attention(q, k, v, causal=True, window=(s // 4, 0), cu_seqlens=[0, s // 4, s])

    want = fn(q, k, v)
    want_g = torch.autograd.grad(want.float().sum(), (q, k, v))
    got = torch.compile(fn, fullgraph=True)(q, k, v)
    got_g = torch.autograd.grad(got.float().sum(), (q, k, v))
    # the forward is the same eager op: equal; flash's backward adds dq in a nondeterministic order
    fwd = (got - want).abs().max().item()
    bwd = max(err(a, b.double()) for a, b in zip(got_g, want_g))
    ok = fwd == 0.0 and bwd <= TOL[torch.bfloat16][1]
    failed += not ok
    print(f"torch.compile(fullgraph=True, inductor) vs eager, docs + window, bf16: out diff {fwd:.1e}, grads "
          f"{bwd:.1e}  {'ok' if ok else 'FAIL'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
