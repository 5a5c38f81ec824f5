"""The lifetime sanitizer on recurrent layers: state passing and a causal convolution's halos.

:func:`sanitize_recurrent` (what ``xcp sanitize --recurrent`` runs) runs, per virtual rank on the simulated
device, a gated delta rule through :func:`xcp.recurrent.state_passing` and a short convolution through
:func:`xcp.recurrent.causal_conv`, forward and backward, and reports what the sanitizer finds (races,
reuses, leaks) and the largest error of every output and gradient against the same kernels on the whole
sequence in float64. The rule it checks is docs/lifetime.md, rule 3.3 (the summaries, halos and their
gradients are handed to the comm stream as the combine's partial is).

The two float64 reference kernels here (:func:`delta_rule`, :func:`short_conv`) are plain per-token loops,
written for checking, not speed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import schedule
from ..api import shard, unshard
from ..comm import LocalWorld
from ..lifetime import check_handoff, track_buffers
from ..recurrent import DeltaRule, causal_conv, state_passing
from .sanitizer import Finding, Sanitizer, SanitizerReport, gathered_findings, on_model, peers_rows


class RecurrentReport(SanitizerReport):
    """A :class:`SanitizerReport` whose errors are against the same kernels on the whole sequence."""

    reference = "the same kernels on the whole sequence (float64)"


TOLERANCE = 1e-10
"""Relative to the largest entry of each output and gradient (float64 throughout)."""


def delta_rule(q, k, v, g, beta, gscale=None, initial_state=None, output_final_state=False):
    """The gated delta rule one token at a time, float64: ``h <- exp(g) (h - beta k (k^T h)) + beta k v^T``,
    ``out = q^T h`` (q, k [B, S, H, K], v [B, S, H, V], g and beta [B, S, H]; state [B, H, K, V]);
    ``gscale`` (a parameter) multiplies g."""
    g = g if gscale is None else g * gscale
    h = initial_state if initial_state is not None else q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None, None]
        h = g[:, t, :, None, None].exp() * (h - bt * kt[..., None] * (kt[..., None, :] @ h))
        h = h + bt * kt[..., None] * vt[..., None, :]
        outs.append((q[:, t, :, None, :] @ h).squeeze(-2))
    return torch.stack(outs, 1), (h if output_final_state else None)


def short_conv(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A causal depthwise convolution with SiLU over [B, L, C] (weight [C, w]), as short-conv layers have."""

    def conv(x: torch.Tensor) -> torch.Tensor:
        y = F.conv1d(x.transpose(1, 2), weight[:, None], padding=weight.shape[1] - 1, groups=weight.shape[0])
        return F.silu(y[..., : x.shape[1]]).transpose(1, 2)

    return conv


def per_document(fn: Callable, inputs: Sequence[torch.Tensor], cu: Sequence[int]) -> tuple[torch.Tensor, Any]:
    """``fn(inputs of a document) -> (out, extra)`` on each document of the whole sequence: the outputs
    concatenated, and the last document's ``extra``."""
    outs, last = [], None
    for a, b in zip(cu, cu[1:]):
        out, last = fn([x[:, a:b] for x in inputs])
        outs.append(out)
    return torch.cat(outs, 1), last


def _inputs(batch: int, seq: int, heads: int, dk: int, dv: int, channels: int, width: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "seq": [r(batch, seq, heads, dk), F.normalize(r(batch, seq, heads, dk), dim=-1), r(batch, seq, heads, dv),
                -r(batch, seq, heads).abs() * 0.3, r(batch, seq, heads).sigmoid(), r(batch, seq, channels)],
        "gscale": torch.tensor(1.3, dtype=torch.float64),
        "weight": r(channels, width),
        "dout": r(batch, seq, heads, dv),
        "dconv": r(batch, seq, channels),
    }  # fmt: skip


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def sanitize_recurrent(
    world: int = 4,
    balance: str = "zigzag",
    handoff: str | None = None,
    seq: int | None = None,
    documents: Sequence[int] | None = None,
    heads: int = 2,
    head_dim: int = 3,
    value_head_dim: int = 4,
    width: int = 4,
    seed: int = 0,
    backend: Callable[[Any], Any] | None = None,
) -> SanitizerReport:
    """State passing and halos on ``world`` virtual ranks of the sim device, forward and backward.

    :param handoff: the hand-off policy of the summaries and halos sent (None: the sim backend's default).
    :param seq: the sequence's tokens (default: 3 per rank, rounded up to what the balance splits).
    :param documents: packed documents' boundaries ``(0, ..., seq)`` (needed by ``document_zigzag``).
    :param backend: ``backend(model)``: another backend on the sim device's streams, used in place of ``sim``
        (:func:`xcp.testing.sanitizer.on_model`; tests/npu_standin.py's ``NPUOnSim``: Ascend's kernels and hand-off).
    :returns: a :class:`xcp.testing.sanitizer.SanitizerReport`; findings of kind race, reuse, leak or numerics.
    """
    for name, value in (("world", world), ("heads", heads), ("head_dim", head_dim),
                        ("value_head_dim", value_head_dim), ("width", width)):  # fmt: skip
        if not schedule.is_integer(value) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1; got {value!r}")
    if handoff is not None:
        check_handoff(handoff)
    if seq is None:
        m = schedule.required_multiple(world, balance)
        seq = -(-3 * world // m) * m
    schedule.check_seq_len(seq, world, balance, what="seq")
    cu = [0, seq] if documents is None else [int(b) for b in documents]
    place: dict[str, Any] = {"balance": balance, "cu_seqlens": cu if balance in schedule.DOCUMENT_BALANCES else None}
    docs = None if documents is None else cu
    data = _inputs(1, seq, heads, head_dim, value_head_dim, 5, width, seed)
    config = {"world": world, "balance": balance, "handoff": handoff, "seq": seq,
              "heads": heads, "head_dim": f"{head_dim}/{value_head_dim}", "width": width}  # fmt: skip
    if documents is not None:
        config["documents"] = ",".join(map(str, cu))

    ref_in = [x.clone().requires_grad_() for x in data["seq"]]
    gscale, weight = data["gscale"].clone().requires_grad_(), data["weight"].clone().requires_grad_()
    out, _ = per_document(lambda xs: delta_rule(xs[0], xs[1], xs[2], xs[3], xs[4], gscale=gscale), ref_in[:5], cu)
    conv, _ = per_document(lambda xs: (short_conv(weight)(xs[0]), None), ref_in[5:], cu)
    ((out * data["dout"]).sum() + (conv * data["dconv"]).sum()).backward()

    with Sanitizer() as san, on_model(san, backend) as used:
        config["handoff"] = handoff or used.handoff_policy
        lw = LocalWorld(world, timeout=60.0)

        def rank(group: Any) -> tuple:
            r = group.rank()
            with san.thread(f"rank{r}"), track_buffers() as ledger:
                local = [shard(x, world, r, **place).requires_grad_() for x in data["seq"]]
                gs, w = data["gscale"].clone().requires_grad_(), data["weight"].clone().requires_grad_()
                options = {
                    "group": group,
                    "balance": balance,
                    "cu_seqlens": docs,
                    "device": used.name,
                    "handoff": handoff,
                }
                o, _ = state_passing(delta_rule, *local[:5], transition=DeltaRule(value=2), gscale=gs, **options)
                c = causal_conv(short_conv(w), local[5], width, **options)
                loss = (o * shard(data["dout"], world, r, **place)).sum()
                (loss + (c * shard(data["dconv"], world, r, **place)).sum()).backward()
                grads = [x.grad for x in local]
                del local, loss
                return ledger, o.detach(), c.detach(), grads, gs.grad, w.grad

        results = lw.run(rank)
        errors = {
            "out": _rel(unshard([res[1] for res in results], **place), out.detach()),
            "conv": _rel(unshard([res[2] for res in results], **place), conv.detach()),
            "grad gscale": _rel(sum(res[4] for res in results), gscale.grad),
            "grad weight": _rel(sum(res[5] for res in results), weight.grad),
        }
        for i, x in enumerate(ref_in):
            errors[f"grad input {i}"] = _rel(unshard([res[3][i] for res in results], **place), x.grad)
        ledgers = [res[0] for res in results]
        del results
        lw.release_buffers()
        del lw
        findings, set_aside = gathered_findings(san, ledgers)
        set_aside += sum(1 for f in findings if peers_rows(f, ("state", "dstate", "halo", "dhalo")))
        findings = [f for f in findings if not peers_rows(f, ("state", "dstate", "halo", "dhalo"))]
    for name, error in errors.items():
        if not error <= TOLERANCE:
            findings.append(
                Finding("numerics", f"{name}: error {error:.3e} against the whole sequence exceeds {TOLERANCE:g}")
            )
    return RecurrentReport(config, findings, peak_kv_shards={}, peak_bytes={}, peak_comm_bytes={}, bound_shards=0,
                           bound_comm_bytes=0, max_error=errors, set_aside=set_aside)  # fmt: skip
