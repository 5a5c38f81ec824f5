"""Check the fused Triton merge against the eager merge on a GPU, and time both (run on a CUDA machine)."""

import sys

import torch

from xcp.cli.common import Clock, median
from xcp.kernels.merge import merge_
from xcp.plugins import select_backend
from xcp_cuda.kernels import fused_merge_


def main() -> int:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b, s, h, d = 1, 16384, 32, 128
    ok = True
    for rows in (slice(None), slice(s // 2, s)):
        out = torch.randn(b, s, h, d, device=dev)
        lse = torch.randn(b, h, s, device=dev) * 4
        lse[:, :, :7] = float("-inf")  # rows that saw nothing yet
        n = out[:, rows].shape[1]
        bo = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
        bl = torch.randn(b, h, n, device=dev) * 4
        bl[:, :, :3] = float("-inf")  # rows the block does not reach
        o1, l1, o2, l2 = out.clone(), lse.clone(), out.clone(), lse.clone()
        merge_(o1, l1, bo, bl, rows)
        fused_merge_(o2, l2, bo, bl, rows)
        eo = (o1 - o2).abs().max().item()
        fin = torch.isfinite(l1)
        el = (l1[fin] - l2[fin]).abs().max().item()
        same_inf = torch.equal(torch.isinf(l1), torch.isinf(l2))
        nan = torch.isnan(o2).any().item() or torch.isnan(l2).any().item()
        good = eo < 1e-5 and el < 1e-5 and same_inf and not nan
        ok &= good
        print(
            f"merge rows={rows}: max|dO|={eo:.2e} max|dL|={el:.2e} inf-equal={same_inf} nan={nan}",
            "ok" if good else "FAIL",
        )
    clock = Clock(select_backend("cuda", None), dev)
    out = torch.randn(b, s, h, d, device=dev)
    lse = torch.randn(b, h, s, device=dev)
    bo = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    bl = torch.randn(b, h, s, device=dev)
    for name, fn in (("eager", merge_), ("fused", fused_merge_)):
        for _ in range(3):
            fn(out, lse, bo, bl)
        t = median([clock.time(lambda f=fn: f(out, lse, bo, bl)) for _ in range(20)])
        moved = out.numel() * (4 + 4 + 2) + lse.numel() * 4 * 3
        print(f"merge {name}: {t * 1e3:.3f} ms over [1, 16K, 32, 128], {moved / t / 1e9:.0f} GB/s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
