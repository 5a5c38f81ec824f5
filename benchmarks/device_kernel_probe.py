"""Which attention kernel does torch SDPA pick on this GPU, how fast is each aten kernel, and does the cuDNN
kernel's backward accept a *merged* out/lse the way the ring uses it? Prints a table; exits 2 without a GPU.

    PYTHONPATH=. python3 benchmarks/device_kernel_probe.py

The ring's block kernel must (a) return its log-sum-exp, (b) take the merged out and lse of a row in its
backward. Flash does both; this script checks whether cuDNN does too, on the shapes the ring makes (none
mask on any Sq x Sk, causal on square blocks, GQA 32/8), against a float64 reference, and times the
kernels side by side (CUDA events, median of 15).
"""

# ruff: noqa: B023 - the timed closures are called inside the iteration that defines them
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks.device_varlen_check import timed as median_ms
from xcp_cuda.kernels import heads_second

ATEN = torch.ops.aten
H, HKV, D = 32, 8, 128
DT = torch.bfloat16


def timed(fn) -> float:
    return median_ms(fn, reps=15, warmup=3)


bhsd = heads_second  # [B, S, H, D] -> the [B, H, S, D] view the aten ops take


def inputs(s: int, sk: int | None = None, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sk = s if sk is None else sk
    q = torch.randn(1, s, H, D, device="cuda", dtype=DT, generator=g)
    k = torch.randn(1, sk, HKV, D, device="cuda", dtype=DT, generator=g)
    v = torch.randn(1, sk, HKV, D, device="cuda", dtype=DT, generator=g)
    dout = torch.randn(1, s, H, D, device="cuda", dtype=DT, generator=g)
    return q, k, v, dout


def rep(x: torch.Tensor) -> torch.Tensor:
    return x.repeat_interleave(H // x.shape[2], dim=2)


def cudnn_fwd(q, k, v, causal, scale=None):
    r = ATEN._scaled_dot_product_cudnn_attention(bhsd(q), bhsd(k), bhsd(v), None, True, 0.0, causal, False, scale=scale)
    return r


def cudnn_bwd(dout, q, k, v, out, lse, r, causal, scale=None):
    return ATEN._scaled_dot_product_cudnn_attention_backward(
        bhsd(dout),
        bhsd(q),
        bhsd(k),
        bhsd(v),
        bhsd(out),
        lse,
        r[6],
        r[7],
        None,
        r[2],
        r[3],
        r[4],
        r[5],
        0.0,
        causal,
        scale=scale,
    )


def flash_fwd(q, k, v, causal, scale=None):
    return ATEN._scaled_dot_product_flash_attention(bhsd(q), bhsd(k), bhsd(v), 0.0, causal, False, scale=scale)


def flash_bwd(dout, q, k, v, out, lse, r, causal, scale=None):
    return ATEN._scaled_dot_product_flash_attention_backward(
        bhsd(dout),
        bhsd(q),
        bhsd(k),
        bhsd(v),
        bhsd(out),
        lse,
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        r[6],
        r[7],
        scale=scale,
    )


def reference(q, k, v, dout, causal):
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, rep(k), rep(v)))
    o = F.scaled_dot_product_attention(bhsd(q64), bhsd(k64), bhsd(v64), is_causal=causal).transpose(1, 2)
    o.backward(dout.double())
    return (
        o.detach(),
        q64.grad,
        k64.grad.reshape(1, k.shape[1], HKV, H // HKV, D).sum(3),
        v64.grad.reshape(1, k.shape[1], HKV, H // HKV, D).sum(3),
    )


def rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def probe_choice() -> None:
    section("torch SDPA's own kernel choice (enable_gqa=True, [B, H, S, D] views of [B, S, H, D])")
    from torch.nn.attention import SDPBackend

    names = {int(b.value) if hasattr(b, "value") else int(b): b.name for b in SDPBackend.__members__.values()}
    for s in (1024, 4096, 16384, 65536):
        for causal in (False, True):
            q, k, v, _ = inputs(s)
            try:
                c = torch._fused_sdp_choice(bhsd(q), bhsd(k), bhsd(v), None, 0.0, causal, scale=None, enable_gqa=True)
                print(f"S={s:6d} causal={causal!s:5}: {names.get(int(c), c)}")
            except Exception as exc:  # noqa: BLE001
                print(f"S={s:6d} causal={causal!s:5}: _fused_sdp_choice raised {type(exc).__name__}: {exc}")


def probe_cudnn_shapes() -> None:
    section("cuDNN op: GQA, lse layout, non-square blocks")
    q, k, v, dout = inputs(1024, 2048)
    for label, kk, vv in (("GQA 32/8 native", k, v), ("repeated 32/32", rep(k), rep(v))):
        try:
            r = cudnn_fwd(q, kk, vv, False)
            print(
                f"{label}: out {tuple(r[0].shape)} stride {r[0].stride()}, lse {tuple(r[1].shape)} "
                f"stride {r[1].stride()} {r[1].dtype}; cum_seq {r[2]}, max {r[4]}, {r[5]}"
            )
            o_ref, *_ = reference(q, kk, vv, dout, False)
            print(f"   out rel err vs float64 {rel(r[0].transpose(1, 2), o_ref):.2e}")
        except Exception as exc:  # noqa: BLE001
            print(f"{label}: raised {type(exc).__name__}: {str(exc)[:300]}")


def merged_check(fwd, bwd, name: str, gqa: bool) -> None:
    """Keys in 2 blocks: block 0 square causal (rows 0..n) and block 1 full (keys n..2n) for q of n rows
    (a zigzag-like step), and a second case of two full blocks; merged out/lse into each block's backward."""
    n = 2048
    for causal_first in (True, False):
        q, k, v, dout = inputs(n, 2 * n, seed=1)
        kv = (k, v) if gqa else (rep(k), rep(v))
        k, v = kv
        blocks = [(slice(0, n), causal_first), (slice(n, 2 * n), False)]
        outs, lses, rs = [], [], []
        for ks, c in blocks:
            r = fwd(q, k[:, ks], v[:, ks], c)
            rs.append(r)
            outs.append(r[0].transpose(1, 2).float())
            lses.append(r[1].float().reshape(1, H, n))
        lse = torch.logaddexp(lses[0], lses[1])
        out = sum(o * torch.exp(lz - lse).transpose(1, 2).unsqueeze(-1) for o, lz in zip(outs, lses))
        out_b = out.to(DT)
        lse_arg = lse.reshape(rs[0][1].shape).to(rs[0][1].dtype).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        dks, dvs = [], []
        for (ks, c), r in zip(blocks, rs):
            g = bwd(dout, q, k[:, ks], v[:, ks], out_b, lse_arg, r, c)
            dq += g[0].transpose(1, 2).float()
            dks.append(g[1].transpose(1, 2))
            dvs.append(g[2].transpose(1, 2))
        dk, dv = torch.cat(dks, 1), torch.cat(dvs, 1)
        # reference: query i sees keys [0, i] of block 0 (if causal) and all of block 1
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, rep(k), rep(v)))
        s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) / D**0.5
        if causal_first:
            mask = torch.ones(n, 2 * n, dtype=torch.bool, device="cuda")
            mask[:, :n] = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
            s = s.masked_fill(~mask, float("-inf"))
        o64 = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v64)
        o64.backward(dout.double())
        groups = H // k.shape[2]

        def fold(g):
            return g.reshape(1, 2 * n, k.shape[2], groups, D).sum(3)

        print(
            f"{name:6} {'GQA' if gqa else 'MHA'} first block {'causal' if causal_first else 'full  '}: "
            f"out {rel(out, o64.detach()):.2e}  dq {rel(dq, q64.grad):.2e}  dk {rel(dk, fold(k64.grad)):.2e}  "
            f"dv {rel(dv, fold(v64.grad)):.2e}"
        )


def probe_merged() -> None:
    section("merged out/lse into each block's backward (2 key blocks), relative 2-norm error vs float64")
    for name, fwd, bwd in (("flash", flash_fwd, flash_bwd), ("cudnn", cudnn_fwd, cudnn_bwd)):
        for gqa in (True, False):
            try:
                merged_check(fwd, bwd, name, gqa)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} gqa={gqa}: raised {type(exc).__name__}: {str(exc)[:300]}")


def probe_speed() -> None:
    section("speed, ms (CUDA events, median of 15); GQA 32/8 D=128 bf16 B=1; cudnn on repeated K/V if GQA fails")
    print(
        f"{'S':>6} {'mask':>6} | {'sdpa f':>7} {'flash f':>7} {'cudnn f':>7} | {'sdpa fb':>7} {'flash fb':>8} "
        f"{'cudnn fb':>8} | sdpa host us"
    )
    for s in (1024, 2048, 4096, 8192, 16384):
        for causal in (False, True):
            q, k, v, dout = inputs(s)
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

            def sdpa_f():
                return F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=causal, enable_gqa=True)

            def sdpa_fb():
                o = F.scaled_dot_product_attention(bhsd(qg), bhsd(kg), bhsd(vg), is_causal=causal, enable_gqa=True)
                o.backward(bhsd(dout))

            rf = flash_fwd(q, k, v, causal)

            def flash_fb():
                r = flash_fwd(q, k, v, causal)
                flash_bwd(dout, q, k, v, r[0].transpose(1, 2), r[1], r, causal)

            try:
                cudnn_fwd(q, k, v, causal)
                ck, cv = k, v
            except Exception:  # noqa: BLE001
                ck, cv = rep(k), rep(v)

            def cudnn_fb():
                r = cudnn_fwd(q, ck, cv, causal)
                cudnn_bwd(dout, q, ck, cv, r[0].transpose(1, 2), r[1], r, causal)

            del rf
            row = [
                timed(sdpa_f),
                timed(lambda: flash_fwd(q, k, v, causal)),
                timed(lambda: cudnn_fwd(q, ck, cv, causal)),
                timed(sdpa_fb),
                timed(flash_fb),
                timed(cudnn_fb),
            ]
            torch.cuda.synchronize()
            import time

            t0 = time.perf_counter()
            for _ in range(200):
                sdpa_f()
            host = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            print(
                f"{s:6d} {'causal' if causal else 'full':>6} | {row[0]:7.3f} {row[1]:7.3f} {row[2]:7.3f} | "
                f"{row[3]:7.3f} {row[4]:8.3f} {row[5]:8.3f} | {host:.0f}",
                flush=True,
            )


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__} cuda {torch.version.cuda} "
        f"cudnn {torch.backends.cudnn.version()}"
    )
    for step in (probe_choice, probe_cudnn_shapes, probe_merged, probe_speed):
        try:
            step()
        except Exception as exc:  # noqa: BLE001
            print(f"{step.__name__} raised {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
