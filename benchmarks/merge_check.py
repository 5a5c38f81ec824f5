"""Check the fused Triton merges against the eager ones on a GPU, and time both (run on a CUDA machine): the
ring's merge of one block, and a KV cache's merge of P ranks' packed partials (decode and chunk shapes, the
float32 packing [D + 1]; the chunk also in the 16-bit packing [D + 2] that bfloat16 inputs gather)."""

import functools
import sys

import torch

from xcp.cli.common import Clock, median
from xcp.inference.partials import merge_into as _merge_into
from xcp.kernels.merge import merge_, packed_lse
from xcp.plugins import select_backend
from xcp_cuda.kernels import fused_merge_, fused_merge_partials_

PARTIAL_SHAPES = (
    ("decode", (8, 8, 1, 32, 128), torch.float32),
    ("chunk", (8, 1, 4096, 32, 128), torch.float32),
    ("chunk", (8, 1, 4096, 32, 128), torch.bfloat16),
)
"""The P-way merge's shapes (P, B, T, H, D) and packings: a decode step's 8 ranks and a chunk of 4096
queries in float32 [D + 1], then the chunk in bfloat16 [D + 2] (outs in 16 bits, the float32 lse's bits in
the last two channels: half the bytes gathered and read)."""


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
        call = functools.partial(fn, out, lse, bo, bl)
        for _ in range(3):
            call()
        t = median([clock.time(call) for _ in range(20)])
        moved = out.numel() * (4 + 4 + 2) + lse.numel() * 4 * 3
        print(f"merge {name}: {t * 1e3:.3f} ms over [1, 16K, 32, 128], {moved / t / 1e9:.0f} GB/s")
    for label, shape, dtype in PARTIAL_SHAPES:
        ok &= partials(clock, dev, label, *shape, dtype=dtype)
    return 0 if ok else 1


def _packed(
    p: int, b: int, t: int, h: int, d: int, dev: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed partials: outs N(0, 1), lse 4 N(0, 1); a third of the (rank, row) pairs saw nothing (lse -inf,
    out 0), and row (t 0, h 0) of every batch no rank saw. float32: [P, B, T, H, D + 1], the lse in channel
    D; bfloat16/float16: [P, B, T, H, D + 2] (D even), the outs rounded to it and the float32 lse's bits in
    channels D, D + 1 (as xcp.inference.cache packs 16-bit inputs)."""
    parts = torch.randn(p, b, t, h, d + 1, device=dev)
    parts[..., d] *= 4
    unseen = torch.rand(p, b, t, h, device=dev) < 0.3
    unseen[:, :, :1, :1] = True
    parts[..., d].masked_fill_(unseen, float("-inf"))
    parts[..., :d].masked_fill_(unseen.unsqueeze(-1), 0.0)
    if dtype == torch.float32:
        return parts
    packed = torch.empty((p, b, t, h, d + 2), dtype=dtype, device=dev)
    packed[..., :d] = parts[..., :d]
    packed[..., d:].view(torch.float32)[..., 0] = parts[..., d]
    return packed


def partials(
    clock: Clock,
    dev: torch.device,
    label: str,
    p: int,
    b: int,
    t: int,
    h: int,
    d: int,
    dtype: torch.dtype = torch.float32,
) -> bool:
    """The P-way merge of packed partials (the packing of ``dtype``, see :func:`_packed`): the fused kernel
    against the eager merge as the cache runs it (xcp.inference.partials.merge_into on the outs and the lse view) and
    float64, then both timed (each call repeated ``reps`` times in one timed region, median of 15)."""
    parts = _packed(p, b, t, h, d, dev, dtype)
    outs, lses = parts[..., :d], packed_lse(parts, d)
    o_eager, o_fused = torch.empty(b, t, h, d, device=dev), torch.full((b, t, h, d), float("nan"), device=dev)
    l_eager = _merge_into(o_eager, outs, lses)
    l_fused = fused_merge_partials_(o_fused, parts)
    o_in, l_in = outs.double(), lses.double()
    l64 = torch.logsumexp(l_in, dim=0)
    o64 = (torch.exp(l_in - torch.where(l64 == float("-inf"), 0.0, l64)).unsqueeze(-1) * o_in).sum(0)
    l64 = l64.transpose(1, 2)
    fin = torch.isfinite(l_eager)
    eo = (o_eager - o_fused).abs().max().item()
    el = (l_eager[fin] - l_fused[fin]).abs().max().item()
    e64 = max((o_fused.double() - o64).abs().max().item(), (l_fused.double() - l64)[fin].abs().max().item())
    same_inf = torch.equal(torch.isneginf(l_eager), torch.isneginf(l_fused))
    nan = bool(o_fused.isnan().any().item() or l_fused.isnan().any().item())
    unseen_zero = bool((o_fused[:, 0, 0] == 0).all().item())
    good = eo < 1e-5 and el < 1e-5 and e64 < 1e-4 and same_inf and not nan and unseen_zero
    name = f"partials {label} {str(dtype).removeprefix('torch.')} (P, B, T, H, D) = {(p, b, t, h, d)}"
    print(
        f"{name}: max|dO|={eo:.2e} max|dL|={el:.2e} vs float64 {e64:.2e} inf-equal={same_inf} nan={nan}",
        "ok" if good else "FAIL",
    )
    if not good:
        return False
    reps = 20 if t == 1 else 5
    times: dict[str, float] = {}
    for kind, fn in (
        ("eager", lambda: _merge_into(o_eager, outs, lses)),
        ("fused", lambda: fused_merge_partials_(o_fused, parts)),
    ):
        for _ in range(3):
            fn()

        def region(fn=fn) -> None:
            for _ in range(reps):
                fn()

        times[kind] = median([clock.time(region) for _ in range(15)]) / reps
    moved = parts.numel() * parts.element_size() + o_fused.numel() * 4 + l_fused.numel() * 4
    print(
        f"{name}: eager {times['eager'] * 1e3:.4f} ms, fused {times['fused'] * 1e3:.4f} ms "
        f"({moved / times['fused'] / 1e9:.0f} GB/s), eager/fused {times['eager'] / times['fused']:.2f}x"
    )
    return True


if __name__ == "__main__":
    sys.exit(main())
