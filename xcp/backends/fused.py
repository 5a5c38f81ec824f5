"""A base for backends whose block kernel is a fused vendor op (CUDA flash, Ascend npu_fusion_attention).

Such ops serve two masks safely, none and causal on a square block, and some of them read
grouped-query K/V natively. The base turns any (mask, Sq, Sk) into those calls (the mask tiling below)
and repeats K/V per query head where the kernel (or the user's ``gqa="repeat"``) asks for it, so a
backend writes only its two square kernels.

Mask tiling, pure torch. Fused kernels (CUDA flash / memory-efficient, Ascend npu_fusion_attention) serve
two masks safely: none, and causal on a *square* block. xcp's masks are top-left aligned on any shape:
``causal`` lets query i see keys 0..i and ``strict`` keys 0..i-1. A kernel's own causal flag is not enough because

- flash-attn (and the flash kernel inside PyTorch) aligns a non-square causal mask to the bottom-right,
  Ascend's usual causal mode (sparse_mode 3) is bottom-right too; only the square case is unambiguous;
- no kernel has a strictly-causal mode: the usual identity "strict = causal on q[1:] against k[:-1]" holds
  when Sq <= Sk, but not beyond (with Sq > Sk, query Sk already sees every key, k[:-1] would drop one).

So every (mask, Sq, Sk) is cut into query-row ranges, in order:

    rows [0, empty)           see no key: out 0, lse -inf, dq 0 (strict row 0; all rows if Sk == 0);
    rows [a, a + n)           square causal against keys [0, n)            (causal, strict);
    rows [..., Sq)            every key [0, Sk), no mask                   (none; causal/strict rows
                                                                              past the last key).

Each query row lies in exactly one piece, so forward results are concatenated, never merged. Keys a
piece does not cover get zero gradient. The ring itself only asks for ``none`` on any shape and for
``causal``/``strict`` on square blocks, which give one kernel call (plus one empty row for strict).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.merge import NEG_INF, accumulator_dtype
from ..schedule import check_mask
from ..settings import READ_AT_CONSTRUCTION, Setting
from .base import Backend, required

# ---------------------------------------------------------------------------------------------- mask tiling
SquareForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]
"""``kernel(q, k, v, causal, scale) -> (out, lse)``; only called with causal on Sq == Sk."""

SquareBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""``kernel(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``; same promise as the forward."""


@functools.lru_cache(maxsize=16)
def op_takes_argument(op: Any, name: str) -> bool:
    """Whether a fused op takes the argument ``name``: an aten overload packet answers from its default overload's
    schema (asked of the op itself, not of torch's version, so a build that backports an argument is served), a
    plain callable standing in for one from its signature; one with neither readable does not."""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    if schema is not None:
        return any(argument.name == name for argument in schema.arguments)
    try:
        return name in inspect.signature(op).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Piece:
    """Query rows [start, stop) against keys [0, keys); ``causal`` means square causal (stop-start == keys)."""

    start: int
    stop: int
    keys: int
    causal: bool


@dataclass(frozen=True)
class Tiling:
    """Rows [0, empty) see no key; ``pieces`` cover rows [empty, Sq) contiguously, in order. ``whole``:
    one kernel call on the unsliced block gives the answer (no slicing, no padding)."""

    sq: int
    sk: int
    empty: int
    pieces: tuple[Piece, ...]
    whole: bool = False

    @classmethod
    def of(cls, sq: int, sk: int, empty: int, pieces: tuple[Piece, ...]) -> Tiling:
        return cls(sq, sk, empty, pieces, empty == 0 and len(pieces) == 1 and pieces[0].keys == sk)


def tile(sq: int, sk: int, mask: str) -> Tiling:
    """The pieces of a block of ``sq`` queries and ``sk`` keys under ``mask`` (see the module docstring)."""
    check_mask(mask)
    if sq < 0 or sk < 0:
        raise ValueError(f"sq, sk: expected lengths >= 0; got {sq}, {sk}")
    if sk == 0 or sq == 0:
        return Tiling.of(sq, sk, sq, ())
    if mask == "none":
        return Tiling.of(sq, sk, 0, (Piece(0, sq, sk, False),))
    shift = 0 if mask == "causal" else 1  # row shift + m sees keys 0..m
    empty = min(shift, sq)
    n = max(0, min(sq - shift, sk))  # rows of the square causal part
    pieces = []
    if n:
        pieces.append(Piece(shift, shift + n, n, True))
    if n == sk and shift + n < sq:  # these rows are past the last key: they see all of them
        pieces.append(Piece(shift + n, sq, sk, False))
    return Tiling.of(sq, sk, empty, tuple(pieces))


def forward(kernel: SquareForward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: float):
    """``(out, lse)`` of the block under ``mask``, from calls of ``kernel`` on its pieces.

    out [B, Sq, H, D] in the kernel's output dtype (zeros on empty rows); lse [B, H, Sq] float32
    (float64 for float64 inputs), -inf on empty rows.
    """
    t = tile(q.shape[1], k.shape[1], mask)
    if t.whole:
        return kernel(q, k, v, t.pieces[0].causal, scale)
    outs, lses = [], []
    for p in t.pieces:
        o, lse = kernel(q[:, p.start : p.stop], k[:, : p.keys], v[:, : p.keys], p.causal, scale)
        outs.append(o)
        lses.append(lse)
    b, sq, h, d = q.shape
    out_dtype = outs[0].dtype if outs else q.dtype
    lse_dtype = lses[0].dtype if lses else accumulator_dtype(q.dtype)
    if t.empty:
        outs.insert(0, torch.zeros((b, t.empty, h, v.shape[3]), dtype=out_dtype, device=q.device))
        lses.insert(0, torch.full((b, h, t.empty), NEG_INF, dtype=lse_dtype, device=q.device))
    out = torch.cat([o.to(out_dtype) for o in outs], dim=1)
    lse = torch.cat([x.to(lse_dtype) for x in lses], dim=2)
    return out, lse


def backward(kernel: SquareBackward, dout, q, k, v, out, lse, mask: str, scale: float):
    """``(dq, dk, dv)`` of the block under ``mask`` from calls of ``kernel`` on its pieces.

    ``out`` and ``lse`` are the merged ones of the rows (the backward of a ring step). Empty rows get
    dq 0; keys no piece covers get dk = dv = 0. Where two pieces add into the same keys the sums are in
    float32 (float64 for float64), otherwise the kernel's dtype is kept.
    """
    t = tile(q.shape[1], k.shape[1], mask)
    if t.whole:
        return kernel(dout, q, k, v, out, lse, t.pieces[0].causal, scale)
    dqs: list[torch.Tensor] = []
    dkv: tuple[torch.Tensor, torch.Tensor] | None = None
    acc = accumulator_dtype(q.dtype)
    for p in t.pieces:
        r = slice(p.start, p.stop)
        gq, gk, gv = kernel(
            dout[:, r], q[:, r], k[:, : p.keys], v[:, : p.keys], out[:, r], lse[:, :, r], p.causal, scale
        )
        dqs.append(gq)
        if dkv is None:
            dkv = _pad_keys(gk, k.shape[1]), _pad_keys(gv, v.shape[1])
        else:  # a second piece: add in the accumulator dtype
            dkv = dkv[0].to(acc), dkv[1].to(acc)
            dkv[0][:, : p.keys] += gk
            dkv[1][:, : p.keys] += gv
    q_dtype = dqs[0].dtype if dqs else q.dtype
    if t.empty:
        dqs.insert(0, torch.zeros((q.shape[0], t.empty, *q.shape[2:]), dtype=q_dtype, device=q.device))
    dq = torch.cat([g.to(q_dtype) for g in dqs], dim=1)
    dk, dv = (torch.zeros_like(k), torch.zeros_like(v)) if dkv is None else dkv
    return dq, dk, dv


AddInto = Callable[[torch.Tensor, torch.Tensor], None]
"""``add(acc, x)``: ``acc += x`` in place (``acc`` a float32 or float64 view); a backend passes its own kernel."""


def _torch_add(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.add_(x)


def backward_as_causal(kernel: SquareBackward, dout, q, k, v, out, lse, scale: float, add: AddInto = _torch_add):
    """``(dq, dk, dv)`` of an unmasked block from causal calls of ``kernel`` alone, in float32 (float64 for
    float64): for a kernel whose causal backward costs less per (query, key) pair than its unmasked one (cuDNN
    at q/k 192, v 128 on an H200, docs/benchmarks.md).

    The block is cut along its longer side into squares of the shorter side (a rest that is not square takes
    one unmasked call). A square's pairs are those with key <= query (one causal call) and those with key >
    query: reversing the order of its rows and of its keys makes the latter strictly causal, which is causal
    attention of the reversed rows 0..n-2 (original n-2..0) against the reversed keys 1..n-1 (original
    n-1..1) -- one more causal call, on reversed copies, whose gradients are reversed back and added.
    """
    sq, sk = q.shape[1], k.shape[1]
    acc = accumulator_dtype(q.dtype)
    grads = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v)]
    side = min(sq, sk)
    for start in range(0, max(sq, sk), side) if side else ():
        stop = min(start + side, max(sq, sk))
        rows, keys = (slice(start, stop), slice(0, sk)) if sq >= sk else (slice(0, sq), slice(start, stop))
        part = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows])
        if stop - start != side:
            _add_grads(add, grads, rows, keys, kernel(*part, False, scale))
            continue
        _add_grads(add, grads, rows, keys, kernel(*part, True, scale))
        if side < 2:
            continue
        below, above = slice(rows.start, rows.stop - 1), slice(keys.start + 1, keys.stop)
        rev = [x[:, below].flip(1) for x in (dout, q)] + [x[:, above].flip(1) for x in (k, v)]
        g = kernel(*rev, out[:, below].flip(1), lse[:, :, below].flip(2), True, scale)
        _add_grads(add, grads, below, above, [x.flip(1) for x in g])
    return tuple(grads)


def _add_grads(add: AddInto, grads: list[torch.Tensor], rows: slice, keys: slice, g) -> None:
    """Add a piece's (dq, dk, dv) into the block's accumulators at its rows and keys."""
    for acc, x, where in zip(grads, g, (rows, keys, keys)):
        add(acc[:, where], x)


def _pad_keys(g: torch.Tensor, sk: int) -> torch.Tensor:
    """``g`` [B, n, Hkv, D] extended with zero rows to [B, sk, Hkv, D] (a new tensor; ``g`` when n == sk)."""
    n = g.shape[1]
    if n == sk:
        return g
    return torch.cat([g, g.new_zeros((g.shape[0], sk - n, *g.shape[2:]))], dim=1)


# ---------------------------------------------------------------------------------------------- GQA
GQA_MODES = ("native", "repeat")
"""``native``: a kernel that reads K/V with fewer heads gets them as they are; ``repeat``: K/V are always
repeated per query head and dK/dV summed over each group (slower, more memory; the fallback when a
kernel's own GQA fails)."""


def gqa_variable(name: str) -> Setting:
    """The setting ``name`` (e.g. ``XCP_CUDA_GQA``) that gives a fused backend's default GQA mode."""
    return Setting(
        name,
        "choice",
        "native",
        "how GQA K/V reach the fused kernel: native (as they are, where the kernel reads fewer K/V heads) or "
        "repeat (repeated per query head, dK/dV summed per group: slower, the fallback when the kernel's own "
        "GQA fails); constructor argument gqa=",
        READ_AT_CONSTRUCTION,
        GQA_MODES,
    )


def check_gqa(mode: str) -> str:
    """Return ``mode`` if it is a GQA mode, else raise a ValueError listing them."""
    if mode not in GQA_MODES:
        raise ValueError(f"gqa: expected one of {', '.join(GQA_MODES)}; got {mode!r}")
    return mode


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv * groups, D]: query head h reads K/V head h // groups (as SDPA's GQA)."""
    return x.repeat_interleave(groups, dim=2) if groups > 1 else x


def widen_head_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero channels appended to its last dim up to ``width`` (``x`` itself when that wide): how a
    kernel that takes one head dim serves values of another (zero channels of q and k add nothing to a
    score; zero channels of v give zero channels of out)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def sum_kv_groups(g: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, S, Hkv * groups, D] -> [B, S, Hkv, D]: the gradient of :func:`repeat_kv` (sum over each group)."""
    if groups == 1:
        return g
    b, s, h, d = g.shape
    return g.reshape(b, s, h // groups, groups, d).sum(3)


class FusedKernelBackend(Backend):
    """Backend base: ``forward``/``backward`` of any mask from the subclass's square kernels.

    :param gqa: ``native`` or ``repeat`` (:data:`GQA_MODES`); default from :attr:`gqa_setting`, else
        ``native``.
    """

    gqa_setting: Setting | None = None
    """The setting that gives the default GQA mode (made by :func:`gqa_variable`, e.g. ``XCP_CUDA_GQA``)."""

    def __init__(self, gqa: str | None = None) -> None:
        if gqa is None:
            gqa = self.gqa_setting.read() if self.gqa_setting is not None else "native"
        self.gqa = check_gqa(gqa)

    def forward(self, q, k, v, mask, scale):
        """(out, lse) of the block under ``mask``; rows that see no key give out 0 and lse -inf."""
        return forward(self.square_forward, q, k, v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        """(dq, dk, dv) of the block from the merged out and lse of its rows, shaped like q, k, v."""
        return backward(self.square_backward, dout, q, k, v, out, lse, mask, scale)

    def kv_groups(self, q: torch.Tensor, k: torch.Tensor, native: bool = True) -> int:
        """How many times K/V are repeated before a kernel call: 1 unless the block is GQA and the kernel
        lacks native GQA (``native=False``) or the mode is ``repeat``."""
        h, hkv = q.shape[2], k.shape[2]
        return h // hkv if h != hkv and (self.gqa == "repeat" or not native) else 1

    @required
    def square_forward(self, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of one block with no mask, or causal on a square block (Sq == Sk)."""
        raise NotImplementedError

    @required
    def square_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """(dq, dk, dv) of one block with no mask, or causal on a square block, from the merged out/lse."""
        raise NotImplementedError
