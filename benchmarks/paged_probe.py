"""Which block sizes the flash varlen op's paged form takes on this GPU, and whether it is exact where it does.

For each block size (default 16, 64, 256, 512 rows) the raw ``aten._flash_attention_forward`` is called with
``block_table`` and ``seqused_k`` over a pool of bf16 blocks (32/8 heads, D 128; decode rows and a causal chunk,
segments of several blocks in a shuffled order, one without keys), and through ``CUDABackend.forward_paged``
(which takes the paged form where it serves and gathers elsewhere). Each call accepted is compared with float64
attention over the segment's rows gathered by hand; a refusal prints the op's message. Usage:
``python benchmarks/paged_probe.py [--blocks 16,64,256,512]``.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from xcp_cuda import kernels
from xcp_cuda.backend import CUDABackend

SEGMENTS = ((1, 3000), (1, 0), (1, 777), (64, 2048), (1, 5))
"""(queries, keys) of the probe's segments: decodes, an empty one, a causal chunk of 64 over 2048 keys."""


def reference(q, k_pool, v_pool, tables, causal):
    """float64 attention of each segment's queries over its rows gathered through its table (causal aligned
    bottom-right), out [T, H, D]."""
    outs, at = [], 0
    for (n, keys), table in zip(SEGMENTS, tables):
        qs = q[at : at + n].double().transpose(0, 1)
        at += n
        if keys == 0:
            outs.append(torch.zeros_like(qs.transpose(0, 1)))
            continue
        k, v = (x[table].flatten(0, 1)[:keys].double() for x in (k_pool, v_pool))
        groups = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(groups, 1).transpose(0, 1) for x in (k, v))
        mask = torch.ones(n, keys, dtype=torch.bool, device=q.device)
        if causal:
            mask = mask.tril(keys - n)
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=1 / math.sqrt(q.shape[-1]))
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def probe(block: int, causal: bool, gen: torch.Generator) -> tuple[str, str]:
    dev = torch.device("cuda")
    h, hkv, d = 32, 8, 128
    widths = [-(-keys // block) for _, keys in SEGMENTS]
    n_blocks = sum(widths) + 1
    order = torch.randperm(n_blocks - 1, generator=torch.Generator().manual_seed(block)).tolist()
    tables, at = [], 0
    for w in widths:
        tables.append(order[at : at + w])
        at += w
    width = max(widths)
    table = torch.tensor([t + [n_blocks - 1] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
    t = sum(n for n, _ in SEGMENTS)
    q = torch.randn(t, h, d, generator=gen, device=dev, dtype=torch.bfloat16)
    k_pool, v_pool = (torch.randn(n_blocks, block, hkv, d, generator=gen, device=dev, dtype=torch.bfloat16)
                      for _ in range(2))  # fmt: skip
    cu = torch.tensor([0] + [sum(n for n, _ in SEGMENTS[: i + 1]) for i in range(len(SEGMENTS))], dtype=torch.int32,
                      device=dev)  # fmt: skip
    used = torch.tensor([keys for _, keys in SEGMENTS], dtype=torch.int32, device=dev)
    max_q, max_k = max(n for n, _ in SEGMENTS), width * block
    want = reference(q, k_pool, v_pool, tables, causal)
    try:
        res = torch.ops.aten._flash_attention_forward(
            q, k_pool, v_pool, cu, torch.zeros_like(cu), max_q, max_k, 0.0, causal, False,
            scale=1 / math.sqrt(d), seqused_k=used, block_table=table,
        )  # fmt: skip
        torch.cuda.synchronize()
        out = res[0].double().nan_to_num()
        err = ((out - want).norm() / want.norm()).item()
        raw = f"accepted, rel err {err:.2e} ({'exact to bf16' if err < 1e-2 else 'NOT EXACT'})"
    except RuntimeError as exc:
        raw = "refused: " + str(exc).strip().splitlines()[0][:100]
    backend = CUDABackend()
    in_place = backend.paged_in_place(q, k_pool, v_pool)
    out, lse = backend.forward_paged(q, k_pool, v_pool, table, cu, used, max_q, max_k, 1 / math.sqrt(d), causal)
    torch.cuda.synchronize()
    err = ((out.double() - want).norm() / want.norm()).item()
    nan = bool(out.isnan().any() or lse.isnan().any())
    via = f"{'in place' if in_place else 'gathered'}, rel err {err:.2e}{' NaN!' if nan else ''}"
    return raw, via


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="16,64,256,512")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"schema: {torch.ops.aten._flash_attention_forward.default._schema}")
    print(f"xcp takes the paged form for blocks of a multiple of {kernels.PAGED_BLOCK_MULTIPLE} rows")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = False
    print(f"{'block':>6} {'mask':>6} | {'aten paged form':<60} | CUDABackend.forward_paged")
    for block in (int(b) for b in args.blocks.split(",")):
        for causal in (False, True):
            raw, via = probe(block, causal, gen)
            bad |= "NOT EXACT" in raw or "NaN" in via or float(via.split("rel err ")[1].split()[0]) > 1e-2
            print(f"{block:>6} {'causal' if causal else 'full':>6} | {raw:<60} | {via}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
