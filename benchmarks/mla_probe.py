"""cuDNN's backward at q/k 192, v 128 across block shapes and masks, against padding v to 192 (cuDNN and
flash at one head dim): which form of a ring's rectangular block is fastest.

    python3 benchmarks/mla_probe.py
"""

from __future__ import annotations

import functools

import torch
from mla_blocks import timed  # this folder, run as a script

from xcp_cuda import kernels


def main() -> None:
    h, dt = 32, torch.bfloat16
    cases = [(4096, 4096, False), (8192, 4096, False), (4096, 8192, False), (8192, 8192, False), (8192, 8192, True)]
    forms = {
        "cudnn 192/128": (kernels.cudnn_forward, kernels.cudnn_backward, 128),
        "cudnn 192/192 (v padded)": (kernels.cudnn_forward, kernels.cudnn_backward, 192),
        "flash 192/192 (v padded)": (kernels.flash_forward, kernels.flash_backward, 192),
    }
    print(f"{'sq x sk, mask':<22}{'form':<28}{'fwd ms':>9}{'bwd ms':>9}")
    for sq, sk, causal in cases:
        for form, (fwd, bwd, dv) in forms.items():
            q = torch.randn(1, sq, h, 192, device="cuda", dtype=dt)
            k = torch.randn(1, sk, h, 192, device="cuda", dtype=dt)
            v = torch.randn(1, sk, h, dv, device="cuda", dtype=dt)
            out, lse = fwd(q, k, v, causal, 0.1)
            dout = torch.randn_like(out)
            f = timed(functools.partial(fwd, q, k, v, causal, 0.1))
            b = timed(functools.partial(bwd, dout, q, k, v, out, lse, causal, 0.1))
            label = f"{sq}x{sk} " + ("causal" if causal else "none")
            print(f"{label:<22}{form:<28}{f:9.3f}{b:9.3f}")


if __name__ == "__main__":
    main()
