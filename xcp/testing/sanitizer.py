"""The lifetime sanitizer: runs the real ring on a simulated asynchronous device and reports broken rules.

Use :func:`sanitize_ring` for a whole check (what ``xcp sanitize`` runs), or a :class:`Sanitizer` session
to run any code on the ``sim`` backend::

    with Sanitizer() as san:                 # registers the backend "sim" until the block ends
        def rank(group):
            with san.thread(f"rank{group.rank()}"):
                ...  # xcp.attention(..., group=group, device="sim"), or ring_forward with san.backend
        xcp.LocalWorld(4).run(rank)
    print(san.findings)

What is checked, and how, is in docs/lifetime.md and :mod:`xcp.testing.sim_device`.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .. import plugins, schedule
from ..api import shard, unshard
from ..comm import LocalWorld
from ..documents import check_window, document_plan
from ..hybrid import (
    check_ulysses_divides,
    check_ulysses_heads,
    hybrid_backward,
    hybrid_config,
    hybrid_forward,
    kv_replicas,
)
from ..lifetime import check_handoff, check_slots, track_buffers
from ..ring import RingConfig, ring_backward, ring_forward
from ..traffic import ring_bytes
from .reference import sdpa_reference
from .sim_backend import SimBackend, SimPlugin
from .sim_device import DeviceModel, Finding

__all__ = ["Finding", "Sanitizer", "SanitizerReport", "sanitize_ring"]

FORWARD_BOUND = 2
"""Received KV shards a rank may hold at once in the forward (rule 2 of xcp.lifetime)."""
BACKWARD_BOUND = 4
"""Received KV and dKV shards a rank may hold at once in the backward."""

# Largest error accepted against the float64 reference, relative to the reference's largest magnitude:
# float64 is exact up to summation order; float32 accumulates in float32 over a few dozen terms; bf16 and
# fp16 results are rounded once to 8 and 11 mantissa bits (2^-8 ~ 4e-3, 2^-11 ~ 5e-4), with margin.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


class Sanitizer:
    """One sanitizer session: a device model and the ``sim`` backend on it, registered while open."""

    def __init__(self) -> None:
        self.model = DeviceModel()
        self.backend = SimBackend(self.model)
        self._plugin = SimPlugin(self.backend)

    def __enter__(self) -> Sanitizer:
        plugins.register_plugin(self._plugin, name="xcp-sanitizer")
        return self

    def __exit__(self, *exc: Any) -> None:
        plugins.unregister_plugin(self._plugin)
        self.model.close()

    def thread(self, label: str) -> contextlib.AbstractContextManager:
        """Run the block as rank ``label``: its own caller stream, every tensor op recorded."""
        return self.model.thread(label)

    def capture(self) -> contextlib.AbstractContextManager:
        """Inside the block the backend reports graph capture (for this thread)."""
        return self.model.capture()

    @property
    def findings(self) -> list[Finding]:
        """Races, reuses and capture violations seen so far."""
        return list(self.model.findings)

    def leaks(self) -> list[Finding]:
        """A ``leak`` finding per buffer the model allocated that is still alive. Drop references first, and
        release the workspace of every world used (``LocalWorld.close`` or ``release_buffers``): it keeps each
        rank's receive slots between calls on purpose, and they would be counted here."""
        gc.collect()
        return [Finding("leak", f"{st.owner}: a buffer of {st.info} was never released") for st in self.model.live()]


@contextlib.contextmanager
def on_model(san: Sanitizer, backend: Callable[[Any], Any] | None) -> Iterator[Any]:
    """The backend a sanitized run uses: the session's ``sim``, or ``backend(model)`` (a backend whose streams and
    events are the session's device model's, e.g. another backend's kernels and hand-off policy on simulated streams)
    registered for the block."""
    if backend is None:
        yield san.backend
        return
    built = backend(san.model)
    plugin = SimPlugin(built)
    plugins.register_plugin(plugin, name=f"xcp-sanitizer-{built.name}")
    try:
        yield built
    finally:
        plugins.unregister_plugin(plugin)


@dataclass
class SanitizerReport:
    """What :func:`sanitize_ring` found. ``ok`` is True when there is no finding."""

    config: dict[str, Any]
    findings: list[Finding]
    peak_kv_shards: dict[int, int]
    peak_bytes: dict[int, int]
    peak_comm_bytes: dict[int, int]
    bound_shards: int
    bound_comm_bytes: int
    max_error: dict[str, float] = field(default_factory=dict)
    document_lengths: tuple[int, ...] | None = None
    """The packed documents' lengths (None: one sequence)."""
    ring_steps: int | None = None
    """Steps the ring ran (P, or fewer where documents or a window leave every later block empty); None: no
    ring ran (the decode path's report)."""
    window: tuple[int | None, int | None] | None = None
    """The sliding window ``(left, right)`` (None: none)."""
    peak_alltoall_bytes: dict[int, int] = field(default_factory=dict)
    """The hybrid's all-to-all receive buffers alive at once per rank (no slots, so outside the bounds)."""
    reference: ClassVar[str] = "float64 SDPA"
    """What the errors were measured against (a report of another path says its own)."""
    set_aside: int = 0
    """Reports set aside, not findings (the hybrid with U >= 3): two peers' copies into their own rows of one
    all-to-all receive buffer, unordered with each other as in any all-to-all, which the model, tracking whole
    storages, reports as a race (docs/lifetime.md, Limits)."""

    @property
    def ok(self) -> bool:
        return not self.findings

    def kinds(self) -> set[str]:
        """The kinds of the findings (race, reuse, leak, bound, capture, numerics)."""
        return {f.kind for f in self.findings}

    def _ring_ranks(self) -> int:
        return self.config["world"] // self.config.get("ulysses", 1)

    def format(self) -> str:
        """A readable report: the configuration, per-rank peaks, then each finding."""
        cfg = " ".join(f"{k}={v}" for k, v in self.config.items())
        lines = [f"xcp sanitize: {cfg}"]
        if self.document_lengths is not None:
            shown = ",".join(map(str, self.document_lengths[:16])) + (",..." if len(self.document_lengths) > 16 else "")
            lines.append(
                f"  documents: {len(self.document_lengths)} packed, lengths {shown}; the ring ran {self.ring_steps} of "
                f"{self._ring_ranks()} steps"
            )
        if self.window is not None:
            left, right = self.window
            lo = "the start" if left is None else f"i-{left}" if left else "i"
            hi = "the end" if right is None else f"i+{right}" if right else "i"
            ran = "" if self.ring_steps is None else f"; the ring ran {self.ring_steps} of {self._ring_ranks()} steps"
            lines.append(f"  window {self.config['window']}: query i sees keys {lo}..{hi}{ran}")
        for r in sorted(self.peak_kv_shards):
            lines.append(
                f"  rank {r}: peak {self.peak_kv_shards[r]} received shards (bound {self.bound_shards}), "
                f"ledger peak {self.peak_bytes[r]} B, received buffers peak {self.peak_comm_bytes.get(r, 0)} B "
                f"(bound {self.bound_comm_bytes} B)"
                + (
                    f", all-to-all receive buffers peak {self.peak_alltoall_bytes.get(r, 0)} B"
                    if self.config.get("ulysses", 1) > 1
                    else ""
                )  # fmt: skip
            )
        ulysses = self.config.get("ulysses", 1)
        if ulysses > 1:
            world = self.config["world"]
            lines.append(
                f"  hybrid: world {world} = ulysses {ulysses} x ring {world // ulysses}: an all-to-all in each head "
                f"group of {ulysses} consecutive ranks, then the ring over the ranks with equal r % {ulysses}; the "
                "bounds are the ring's, for its K/V shards of S/R tokens and H_kv'/U heads; the all-to-all's receive "
                "buffers are no slots (counted apart, no bound)"
            )
        if self.set_aside:
            lines.append(
                f"  set aside: {self.set_aside} report(s) of two peers writing their own rows of one all-to-all "
                "receive buffer, unordered with each other as in any all-to-all (disjoint rows; the model tracks "
                "whole storages: docs/lifetime.md, Limits)"
            )
        if self.max_error:
            errs = ", ".join(f"{k} {v:.2e}" for k, v in self.max_error.items())
            masked = _masked(self.document_lengths, self.window)
            lines.append(f"  largest error against {self.reference}{masked}: {errs}")
        if self.ok:
            lines.append("  no finding: every access ordered, no reuse hazard, nothing leaked, peaks within bounds")
        else:
            lines.append(f"  {len(self.findings)} finding(s):")
            lines.extend("  " + f.format().replace("\n", "\n  ") for f in self.findings)
        return "\n".join(lines)


def _masked(documents: object, window: object) -> str:
    """`` with the banded document mask`` and the like: which mask the reference had."""
    kinds = [name for name, on in (("banded", window is not None), ("document", documents is not None)) if on]
    return f" with the {' '.join(kinds)} mask" if kinds else ""


def gathered_findings(san: Sanitizer, ledgers: list[Any]) -> tuple[list[Finding], int]:
    """The findings of a run of the caches' combine (after the world released its buffers): the sanitizer's,
    less the reports of two peers writing their own rows of one receive buffer (:func:`peers_rows`, counted
    apart), a leak per rank whose ledger still counts bytes, and every buffer never released."""
    set_aside = [f for f in san.findings if peers_rows(f)]
    findings = [f for f in san.findings if not any(f is a for a in set_aside)]
    for r, ledger in enumerate(ledgers):
        if ledger.live_bytes:
            findings.append(Finding("leak", f"rank{r}: the ledger counts {ledger.live_bytes} B after the calls"))
    return findings + san.leaks(), len(set_aside)


def peers_rows(finding: Finding, tags: tuple[str, ...] = ("a2a", "combine")) -> bool:
    """True for a race between two different peers' copies into one receive buffer of an all-to-all or
    all-gather (``tags``; each writes its own row, so the writes are disjoint; the model tracks whole storages
    and cannot tell): what :func:`sanitize_ring` sets aside for the hybrid, and the decode sanitizer for the
    KV cache's combine. A race involving anything else is not."""
    ops = [a.op for a in finding.accesses]
    one_tag = any(all(f"(p2p {tag}" in op for op in ops) for tag in tags)
    return finding.kind == "race" and len(ops) > 1 and one_tag and len(set(ops)) == len(ops)


def _by_rank(peaks: dict[str, int]) -> dict[int, int]:
    """A per-thread peak of the sanitizer's model, for the rank threads (``rank<r>``), by rank."""
    return {int(label[4:]): b for label, b in peaks.items() if label.startswith("rank")}


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}; got {value!r}")
    return value


def random_document_lengths(seq: int, documents: int, seed: int = 0) -> tuple[int, ...]:
    """``documents`` lengths >= 1 summing to ``seq``, drawn from ``seed``: cut points uniform among the
    ``seq - 1`` gaps, and, where there are two documents or more and some room, at least one document of a
    single token (the smallest segments are where off-by-one masks show)."""
    _check_int("documents", documents, 1)
    if documents > seq:
        raise ValueError(f"documents: expected at most seq={seq} documents (each at least 1 token); got {documents}")
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted((torch.randperm(seq - 1, generator=gen)[: documents - 1] + 1).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
    if documents >= 2 and min(lengths) > 1:
        i = int(torch.randint(documents, (), generator=gen))
        j = i + 1 if i + 1 < documents else i - 1  # the neighbour that takes the rest of document i
        lengths[j] += lengths[i] - 1
        lengths[i] = 1
    return tuple(lengths)


def document_mask(cu: tuple[int, ...], causal: bool) -> torch.Tensor:
    """Boolean [S, S]: query i may see key j iff both lie in one document (and j <= i when causal)."""
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    allowed = doc.unsqueeze(1) == doc.unsqueeze(0)
    if causal:
        allowed &= torch.ones(cu[-1], cu[-1], dtype=torch.bool).tril()
    return allowed


def window_mask(seq: int, window: tuple[int | None, int | None]) -> torch.Tensor:
    """Boolean [S, S]: query i may see key j iff ``i - left <= j <= i + right`` (None: unbounded)."""
    left, right = window
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    allowed = torch.ones(seq, seq, dtype=torch.bool)
    if left is not None:
        allowed &= j >= i - left
    if right is not None:
        allowed &= j <= i + right
    return allowed


def _masked_reference(q, k, v, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 SDPA of [B, S, H, D] inputs under a boolean [S, S] mask (every row sees a key), K/V heads
    repeated for GQA."""
    groups = q.shape[2] // k.shape[2]
    qd, kd, vd = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        qd, kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1), attn_mask=allowed, scale=scale
    )
    return out.transpose(1, 2)


def sanitize_ring(
    world: int = 4,
    causal: bool = True,
    balance: str = "zigzag",
    handoff: str | None = None,
    backward: bool = False,
    dtype: torch.dtype = torch.float64,
    heads: int = 4,
    kv_heads: int = 2,
    seq: int | None = None,
    head_dim: int = 8,
    batch: int = 1,
    slots: str = "bounded",
    calls: int = 1,
    seed: int = 0,
    documents: int | None = None,
    window: tuple[int | None, int | None] | None = None,
    ulysses: int = 1,
    value_head_dim: int | None = None,
) -> SanitizerReport:
    """Run the ring on ``world`` virtual ranks of the sim device and check every lifetime rule.

    :param world: number of ranks P.
    :param balance: a whole-sequence balance, or ``document_zigzag`` with ``documents`` (each document
        zigzagged over the ranks; ``seq`` then need not be a multiple of P without ulysses: the shards differ by
        a token and travel as long as the longest, which the byte bound counts).
    :param handoff: hand-off policy (``record_stream``, ``clone``, ``event``, ``none``); None: the sim
        backend's default, ``record_stream``.
    :param backward: also run the backward pass (then the bound is 4 shards instead of 2).
    :param seq: global sequence length; default 4 tokens per rank (with ``documents``, at least one token
        per document, rounded up to what the balance can split).
    :param slots: the slot policy, ``bounded`` or ``keep_all`` (which must exceed the bound for P >= 4).
    :param calls: calls per rank (more than one exercises the workspace).
    :param documents: pack the sequence with this many documents (random lengths from ``seed``, at least one
        of a single token where there are two or more): the ring runs with ``RingConfig.documents`` and is
        checked against float64 SDPA under the document mask; the bounds stay the same, since blocks
        with nothing to compute must not change what is alive.
    :param window: a sliding window ``(left, right)`` (see :func:`xcp.documents.check_window`), alone or with
        ``documents``: the ring runs only the steps the window needs and is checked against float64 SDPA
        under the banded (and document) mask, within the same bounds.
    :param ulysses: U > 1 runs the hybrid all-to-all + ring (:func:`xcp.hybrid.hybrid_forward` /
        ``hybrid_backward``) on ``world`` = U x R ranks, shards placed by ``xcp.shard(..., ulysses=U)``; the
        bounds are the ring's, for its K/V shards of S/R tokens and H_kv'/U heads (the all-to-all buffers are
        no slots: docs/lifetime.md, the hybrid's all-to-all). Races between two peers' copies into their own
        rows of one all-to-all receive buffer (U >= 3) are set aside (:func:`peers_rows`), and counted.
    :param value_head_dim: v's head dim (and out's, dout's, dv's), None: ``head_dim``; another one is multi-head
        latent attention's: the K/V shards and dK/dV messages then hold K in ``head_dim`` and V in this one.
    :returns: a :class:`SanitizerReport`; findings of kind race, reuse, leak, bound, capture or numerics.
    """
    _check_int("world", world, 1)
    _check_int("heads", heads, 1)
    _check_int("kv_heads", kv_heads, 1)
    _check_int("head_dim", head_dim, 1)
    value_dim = head_dim if value_head_dim is None else _check_int("value_head_dim", value_head_dim, 1)
    _check_int("batch", batch, 1)
    _check_int("calls", calls, 1)
    _check_int("ulysses", ulysses, 1)
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}; got {kv_heads}")
    ring = check_ulysses_divides(ulysses, world, "world")  # the ranks of a ring (P without ulysses)
    check_ulysses_heads(ulysses, heads)
    if not isinstance(causal, bool) or not isinstance(backward, bool):
        raise TypeError("causal and backward: expected bools")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype: expected one of {', '.join(map(str, TOLERANCE))}; got {dtype}")
    schedule.check_balance(balance, documents=True)
    if balance in schedule.DOCUMENT_BALANCES and documents is None:
        raise ValueError(f"documents: expected a number of documents with balance {balance!r} (it places each "
                         "document over the ranks); got None")  # fmt: skip
    check_slots(slots)
    if handoff is not None:
        check_handoff(handoff)
    if documents is not None:
        _check_int("documents", documents, 1)
        if batch != 1:
            raise ValueError(f"batch: expected 1 with documents (the packed layout); got {batch}")
    window = check_window(window, causal)
    if window is not None and batch != 1:
        raise ValueError(f"batch: expected 1 with a window (the ring plans it as one packed sequence); got {batch}")
    if seq is None:
        seq = 4 * world
        if documents is not None and documents > seq:  # room for every document, split evenly by the balance
            m = math.lcm(schedule.required_multiple(ring, balance), world)
            seq = -(-documents // m) * m
    else:
        _check_int("seq", seq, 1)
    schedule.check_seq_len(seq, ring, balance, what="seq")
    if ulysses > 1 and seq % world:  # (without ulysses the balance's own check covers it)
        raise ValueError(
            f"seq: expected a multiple of world={world} with ulysses={ulysses} (each of the {ring} ring shards is cut "
            f"into {ulysses} pieces); got {seq}"
        )
    if ring > 1 and causal and balance == "zigzag" and (seq // ring) % 2:
        raise ValueError(f"seq: zigzag needs an even number of tokens per rank of a ring; got {seq // ring}")

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(batch, seq, kv_heads, value_dim, generator=gen, dtype=torch.float64).to(dtype)
    dout = torch.randn(batch, seq, heads, value_dim, generator=gen, dtype=torch.float64).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    lengths = cu = steps = None
    if documents is not None:
        lengths = random_document_lengths(seq, documents, seed)
        cu = tuple(int(x) for x in torch.tensor((0, *lengths)).cumsum(0).tolist())
    ring_cu = (0, seq) if cu is None and window is not None else cu  # a window is planned over (0, S)
    if ring_cu is not None:
        steps = len(document_plan(ring_cu, ring, 0, causal, balance, window).steps)
    leaves = [x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v)]
    q64, k64, v64 = leaves
    if ring_cu is None:
        ref = sdpa_reference(q64, k64, v64, causal, scale)
    else:
        allowed = document_mask(ring_cu, causal)
        if window is not None:
            allowed &= window_mask(seq, window)
        ref = _masked_reference(q64, k64, v64, allowed, scale)
    refs = {"out": ref.detach()}
    if backward:
        refs.update(zip(("dq", "dk", "dv"), torch.autograd.grad(ref, leaves, dout.double())))

    bound = BACKWARD_BOUND if backward else FORWARD_BOUND
    # a ring shard: S/R tokens with H_kv'/U K/V heads (S/P and H_kv without ulysses)
    ring_kv_heads = kv_heads * kv_replicas(heads, kv_heads, ulysses) // ulysses
    # two K/V shards (and two dK/dV messages), as long as the longest shard: those the ring's slots hold
    sent = ring_bytes(seq, ring, ring, ring_kv_heads, head_dim, value_dim, dtype, balance, batch)
    bound_bytes = 2 * (sent.kv_shard + (sent.dkv_message if backward else 0))
    config = {
        "world": world, "causal": causal, "balance": balance, "handoff": handoff or SimBackend.handoff_policy,
        "backward": backward, "dtype": str(dtype).replace("torch.", ""), "heads": heads, "kv_heads": kv_heads,
        "seq": seq, "slots": slots, "calls": calls, "documents": documents,
    }  # fmt: skip
    if value_dim != head_dim:
        config["head_dim"] = f"{head_dim}/{value_dim}"
    if window is not None:
        config["window"] = ",".join("none" if x is None else str(x) for x in window)
    if ulysses > 1:
        config["ulysses"] = ulysses

    findings: list[Finding] = []
    with Sanitizer() as san:
        lw = LocalWorld(world, timeout=60.0)

        placed = cu if balance in schedule.DOCUMENT_BALANCES else None  # what shard and unshard place by

        def rank(group: Any) -> tuple:
            with san.thread(f"rank{group.rank()}"), track_buffers() as ledger:
                ql, kl, vl, dl = (shard(x, world, group.rank(), balance=balance, ulysses=ulysses, cu_seqlens=placed)
                                  for x in (q, k, v, dout))  # fmt: skip
                if ulysses > 1:
                    for _ in range(calls):
                        hcfg = hybrid_config(ql, kl, group, san.backend, ulysses, causal=causal, scale=scale,
                                             balance=balance, slots=slots, handoff=handoff, cu_seqlens=cu,
                                             window=window)  # fmt: skip
                        out, state = hybrid_forward(ql, kl, vl, hcfg)
                        grads = hybrid_backward(dl, state, hcfg) if backward else ()
                        del state
                    return ledger, (out, *grads)
                cfg = RingConfig(group, san.backend, causal, scale, balance, slots, handoff, ring_cu, window)
                for _ in range(calls):
                    out, lse = ring_forward(ql, kl, vl, cfg)
                    grads = ring_backward(dl, ql, kl, vl, out, lse, cfg) if backward else ()
                return ledger, (out, *grads)

        results = lw.run(rank)
        ledgers = [r[0] for r in results]
        errors = {}
        for i, name in enumerate(refs):
            got = unshard([r[1][i] for r in results], balance=balance, ulysses=ulysses, cu_seqlens=placed).double()
            errors[name] = (got - refs[name]).abs().max().item() / max(1.0, refs[name].abs().max().item())
        del results
        lw.release_buffers()
        del lw
        set_aside = [f for f in san.findings if ulysses > 1 and peers_rows(f)]
        findings.extend(f for f in san.findings if not any(f is a for a in set_aside))
        for r, ledger in enumerate(ledgers):
            if ledger.live_bytes:
                findings.append(Finding("leak", f"rank{r}: the ledger counts {ledger.live_bytes} B after the calls"))
            if ledger.peak_kv_shards > bound:
                findings.append(
                    Finding(
                        "bound",
                        f"rank{r}: {ledger.peak_kv_shards} received shards alive at once (ledger); bound {bound}",
                    )
                )
        peaks = {  # per rank: received shards and bytes (ledger), received and all-to-all buffers (sanitizer)
            "peak_kv_shards": {r: led.peak_kv_shards for r, led in enumerate(ledgers)},
            "peak_bytes": {r: led.peak_bytes for r, led in enumerate(ledgers)},
            "peak_comm_bytes": _by_rank(san.model.comm_peak),
            "peak_alltoall_bytes": _by_rank(san.model.alltoall_peak),
        }
        for r, peak in sorted(peaks["peak_comm_bytes"].items()):
            if peak > bound_bytes:
                findings.append(
                    Finding(
                        "bound",
                        f"rank{r}: received buffers peaked at {peak} B alive at once (sanitizer); the bound is "
                        f"{bound_bytes} B ({bound} shards)",
                    )
                )
        findings.extend(san.leaks())
    tol = TOLERANCE[dtype]
    for name, err in errors.items():
        if not err <= tol:
            against = f"float64 SDPA{_masked(cu, window)}"
            findings.append(Finding("numerics", f"{name}: error {err:.3e} against {against} exceeds {tol:g}"))
    return SanitizerReport(
        config, findings, bound_shards=bound, bound_comm_bytes=bound_bytes, max_error=errors, **peaks,
        document_lengths=lengths, ring_steps=ring if steps is None else steps, window=window, set_aside=len(set_aside),
    )  # fmt: skip
