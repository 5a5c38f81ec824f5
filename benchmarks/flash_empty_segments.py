"""Does aten's flash varlen op take segments with no queries (a gap of keys between two documents' keys)?
If it does, a block whose segments' keys are not contiguous can go as one call with filler segments.
Checks forward and backward against per-segment SDPA, on the GPU.

    python3 benchmarks/flash_empty_segments.py
"""

from __future__ import annotations

import torch

ATEN = torch.ops.aten


def main() -> None:
    h, d, dt = 4, 64, torch.bfloat16
    cu_q = [0, 5, 5, 12, 12, 20]  # three real segments, two fillers with no queries
    cu_k = [0, 9, 13, 21, 30, 36]  # the fillers' keys (4 and 9) are seen by no query
    q = torch.randn(cu_q[-1], h, d, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(cu_k[-1], h, d, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(cu_k[-1], h, d, device="cuda", dtype=dt, requires_grad=True)
    cq, ck = (torch.tensor(c, device="cuda", dtype=torch.int32) for c in (cu_q, cu_k))
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    try:
        out, lse, *rest = ATEN._flash_attention_forward(q, k, v, cq, ck, max(lens_q), max(lens_k), 0.0, False,
                                                        False, scale=0.125)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the answer is the refusal
        print(f"forward refused: {type(exc).__name__}: {str(exc)[:200]}")
        return
    want = torch.empty_like(out)
    for a, b, c, e in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if a < b:
            qs, ks, vs = (x.detach().transpose(0, 1).unsqueeze(0) for x in (q[a:b], k[c:e], v[c:e]))
            want[a:b] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=0.125)[0].transpose(0, 1)
    err = (out.float() - want.float()).abs().max().item()
    print(f"forward accepted; max error against per-segment SDPA {err:.2e}; lse shape {tuple(lse.shape)}")
    dout = torch.randn_like(out)
    try:
        seed, offset = rest[0], rest[1]
        dq, dk, dv = ATEN._flash_attention_backward(dout, q, k, v, out, lse, cq, ck, max(lens_q), max(lens_k), 0.0,
                                                    False, seed, offset, scale=0.125)  # fmt: skip
        filler = torch.cat([dk[9:13], dk[21:30]]).abs().max().item()
        finite = bool(dq.isfinite().all())
        print(f"backward accepted; the fillers' dK max |x| {filler:.2e} (0 expected); dq finite {finite}")
    except Exception as exc:  # noqa: BLE001 - the answer is the refusal
        print(f"backward refused: {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
