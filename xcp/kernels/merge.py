"""Online log-sum-exp merge of partial attention outputs.

Each block gives (O_b, L_b), L_b the log-sum-exp of the block's scores per query row. The running
(O, L) is updated in the stable form

    L' = logaddexp(L, L_b),   O' = O - sigmoid(L_b - L) * (O - O_b)

which never exponentiates a large number. Rows that no key may attend to keep L = -inf and O = 0:
the weight of a block whose L_b is -inf is forced to 0, so -inf - -inf never reaches the output.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 inputs accumulate in float64, every other dtype in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


HALF_DTYPES = (torch.bfloat16, torch.float16)


def packed_layout(dtype: torch.dtype, head_dim: int) -> tuple[torch.dtype, int]:
    """The dtype and channels of a partial ``[out | lse]`` packed in one buffer for the inputs' ``dtype``.

    A 16-bit out goes as it is, its float32 lse stored bit for bit in two more 16-bit channels (D + 2): a
    fused kernel's 16-bit out loses nothing, and the buffer is half the float32 one's bytes. Otherwise (or
    for an odd D, where the lse's bits would not be aligned) out and lse in the accumulator dtype (D + 1).
    """
    if dtype in HALF_DTYPES and head_dim % 2 == 0:
        return dtype, head_dim + 2
    return accumulator_dtype(dtype), head_dim + 1


def packed_lse(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The lse channel of packed partials (any leading dims), as a view in float32 (or float64)."""
    if packed.dtype in HALF_DTYPES:
        return packed[..., head_dim : head_dim + 2].view(torch.float32)[..., 0]
    return packed[..., head_dim]


def new_accumulators(
    q: torch.Tensor, empty: bool = False, value_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running output [B, S, H, Dv] (zeros) and log-sum-exp [B, H, S] (-inf) for queries ``q``, Dv the
    values' head dim (``value_dim``; default q's); with ``empty``, uninitialised (for a kernel that writes
    every element without reading any)."""
    acc = accumulator_dtype(q.dtype)
    b, s, h, d = q.shape
    d = d if value_dim is None else value_dim
    if empty:
        return torch.empty((b, s, h, d), dtype=acc, device=q.device), torch.empty((b, h, s), dtype=acc, device=q.device)
    out = torch.zeros((b, s, h, d), dtype=acc, device=q.device)
    lse = torch.full((b, h, s), NEG_INF, dtype=acc, device=q.device)
    return out, lse


def merge_(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    rows: slice = slice(None),
) -> None:
    """Fold one block into the running (out, lse) in place, on query rows ``rows``.

    :param out: running output [B, S, H, D], accumulator dtype; updated in place.
    :param lse: running log-sum-exp [B, H, S], accumulator dtype; updated in place.
    :param block_out: the block's output [B, s, H, D] for the rows, any float dtype.
    :param block_lse: the block's log-sum-exp [B, H, s], -inf where a row saw no key.
    :param rows: the slice of query rows the block covers.
    """
    o = out[:, rows]
    l_old = lse[:, :, rows]
    b_lse = block_lse.to(lse.dtype)
    weight = torch.where(b_lse == NEG_INF, 0.0, torch.sigmoid(b_lse - l_old))
    o.sub_(weight.transpose(1, 2).unsqueeze(-1) * (o - block_out.to(o.dtype)))
    l_old.copy_(torch.logaddexp(l_old, b_lse))


def apply_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Add one value-less logit per head to every row's softmax, in place, after the merge.

    ``L' = logaddexp(L, sinks[h])`` and ``out' = out * exp(L - L')``: the same as attending to an extra key
    whose score is ``sinks[h]`` and whose value is zero. Rows with ``L' = -inf`` (no key, sink -inf) stay 0.

    :param out: merged output [B, S, H, D] (accumulator dtype).
    :param lse: merged log-sum-exp [B, H, S] (accumulator dtype).
    :param sinks: [H], any float dtype.
    """
    sink = sinks.detach().to(lse.dtype).view(1, -1, 1)
    new = torch.logaddexp(lse, sink)
    factor = torch.where(new == NEG_INF, 0.0, torch.exp(lse - torch.where(new == NEG_INF, 0.0, new)))
    out.mul_(factor.transpose(1, 2).unsqueeze(-1))
    lse.copy_(new)


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the loss in ``sinks`` [H] from this rank's rows: ``-sum_rows p_sink * (dout . out)``.

    :param out: the final output [B, S, H, D]; ``lse`` the final log-sum-exp [B, H, S] (sink included).
    """
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, S]
    sink = sinks.detach().to(acc).view(1, -1, 1)
    p_sink = torch.where(lse == NEG_INF, 0.0, torch.exp(sink - torch.where(lse == NEG_INF, 0.0, lse)))
    return (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
