"""Ranks agree on a call before its ring runs.

Ranks called with different ``causal``, ``balance``, ``scale``, shapes, dtypes, documents, sinks, windows,
``ulysses``, soft-caps, ALiBi slopes (their shape and dtype) or chunks would run rings whose shards do not
fit together and return wrong results without an error (or, for ``ulysses``, wait for peers that never
come). So the first call of each configuration passes a
fingerprint (a few int64; the document boundaries as a CRC) around the ring: every rank then holds every
rank's values, and where they differ all ranks raise the same error, naming the fields and each rank's
value.

A configuration joins the set of agreed ones only after a check in which every rank of the group took
part, so the set is the same on every rank and later calls with an agreed configuration skip the check
on all ranks together. What this cannot see: ranks that each pass a *different* configuration the group
has already agreed on (the check runs on first use only, to cost nothing afterwards).
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from . import schedule
from .spec import CallSpec

FIELDS = (  # the agreed fields of xcp.spec.CallSpec (documents as cu_seqlens), the shards' shapes and dtypes
    "causal",
    "balance",
    "scale",
    "q.shape",
    "k.shape",
    "v.shape",
    "q.dtype",
    "k.dtype",
    "v.dtype",
    "cu_seqlens",
    "sinks",
    "window",
    "ulysses",
    "softcap",
    "alibi_slopes",
    "chunk",
)
MAX_AGREED = 4096
"""Agreed fingerprints a rank remembers per group; when full the set starts afresh (on every rank at the
same call, since every rank adds the same fingerprints in the same order)."""

_DIMS = 4
_process_agreed: dict[tuple, set] = {}
_lock = threading.Lock()


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _dtype_names() -> dict[int, str]:
    return {_dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _shape(x: torch.Tensor, seq_len: int | None = None) -> list[int]:
    dims = list(x.shape)[:_DIMS]
    if seq_len is not None:  # shards of a document balance differ by a token: their global length instead
        dims[1] = seq_len
    return dims + [-1] * (_DIMS - len(dims))


def fingerprint(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    balance: str,
    scale: float,
    documents: tuple[int, ...] | None = None,
    sinks: torch.Tensor | None = None,
    window: tuple | None = None,
    ulysses: int = 1,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple:
    """The configuration of a call as int64 values, in the order of :data:`FIELDS` (documents as their
    count and a CRC of the boundaries; sinks as their length and dtype; -1 where absent; ``ulysses`` the
    head-group size of the hybrid, 1 for the ring alone; softcap as its bits, alibi_slopes as their length and
    dtype, chunk as it is). Under a document balance the shards' lengths may
    differ by a token, so their shapes carry the global length ``documents[-1]`` instead (each rank's own
    length is checked against it before: :func:`xcp.checks.check_documents`)."""
    (scale_bits,) = struct.unpack("<q", struct.pack("<d", float(scale)))
    values = [int(bool(causal)), schedule.ALL_BALANCES.index(balance), scale_bits]
    placed = documents[-1] if documents is not None and balance in schedule.DOCUMENT_BALANCES else None
    for x in (q, k, v):
        values += _shape(x, placed)
    values += [_dtype_code(x.dtype) for x in (q, k, v)]
    if documents is None:
        values += [-1, -1]
    else:
        values += [len(documents) - 1, zlib.crc32(struct.pack(f"<{len(documents)}q", *documents))]
    values += [-1, -1] if sinks is None else [sinks.numel(), _dtype_code(sinks.dtype)]
    values += [-2, -2] if window is None else [-1 if w is None else w for w in window]
    values.append(int(ulysses))
    values.append(-1 if softcap is None else struct.unpack("<q", struct.pack("<d", float(softcap)))[0])
    values += [-1, -1] if alibi_slopes is None else [alibi_slopes.numel(), _dtype_code(alibi_slopes.dtype)]
    values.append(-1 if chunk is None else int(chunk))
    return tuple(values)


def describe(values: Sequence[int]) -> dict[str, Any]:
    """Field name -> readable value of a fingerprint."""
    names = _dtype_names()
    causal, balance, scale_bits = values[:3]
    shapes = [tuple(d for d in values[3 + i * _DIMS : 3 + (i + 1) * _DIMS] if d >= 0) for i in range(3)]
    tail = 3 + 3 * _DIMS
    dtypes = [names.get(c, f"dtype#{c}") for c in values[tail : tail + 3]]
    docs, crc, sinks, sinks_dtype, left, right, ulysses, softcap_bits, slopes, slopes_dtype, chunk = values[
        tail + 3 : tail + 14
    ]
    (scale,) = struct.unpack("<d", struct.pack("<q", scale_bits))
    balances = schedule.ALL_BALANCES
    return dict(
        zip(
            FIELDS,
            [
                bool(causal),
                balances[balance] if 0 <= balance < len(balances) else balance,
                scale,
                *shapes,
                *dtypes,
                None if docs < 0 else f"{docs} documents (crc32 {crc:08x})",
                None if sinks < 0 else f"[{sinks}] {names.get(sinks_dtype, sinks_dtype)}",
                None if left == -2 else tuple(None if w == -1 else w for w in (left, right)),
                ulysses,
                None if softcap_bits == -1 else struct.unpack("<d", struct.pack("<q", softcap_bits))[0],
                None if slopes < 0 else f"[{slopes}] {names.get(slopes_dtype, slopes_dtype)}",
                None if chunk < 0 else chunk,
            ],
        )
    )


def disagreement(rows: Sequence[Sequence[int]]) -> str | None:
    """None when every rank's fingerprint is the same, else a message naming each field that differs and
    the ranks holding each value."""
    if all(tuple(r) == tuple(rows[0]) for r in rows):
        return None
    described = [describe(r) for r in rows]
    parts = []
    for field in FIELDS:
        by_value: dict[str, list[int]] = {}
        for rank, d in enumerate(described):
            by_value.setdefault(repr(d[field]), []).append(rank)
        if len(by_value) > 1:
            holders = "; ".join(
                f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {value}"
                for value, ranks in by_value.items()
            )
            parts.append(f"{field} ({holders})")
    return (
        "xcp: the ranks of the group called attention with different arguments: "
        + "; ".join(parts)
        + ". Every rank must pass the same causal, balance, scale and ulysses, and shards of equal shape and dtype."
    )


def agreed_set(comm: Any) -> set:
    """The fingerprints this rank's group has agreed on: per virtual rank for ranks that are threads, else
    per process and group membership (so a rank's calls from several threads share one set)."""
    members = getattr(comm, "members", None)
    if comm.ranks_are_threads or members is None:
        return comm.rank_store().setdefault("agreed", set())
    with _lock:
        return _process_agreed.setdefault(tuple(members), set())


def ring_gather(comm: Any, backend: Any, mine: torch.Tensor) -> list[list[int]]:
    """Every rank's ``mine`` (a small int64 tensor), in rank order: P - 1 hops around the ring."""
    size, rank = comm.size(), comm.rank()
    rows = [mine] * size
    current = mine
    for hop in range(size - 1):
        buf = torch.empty_like(mine)
        comm.exchange([(current, (rank + 1) % size)], [(buf, (rank - 1) % size)], "agree", backend, step=hop).wait()
        rows[(rank - 1 - hop) % size] = current = buf
    return torch.stack(rows).tolist()  # one host read (a device sync) for all of them


def check_agreement(
    comm: Any,
    backend: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: CallSpec,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Raise a ValueError on every rank when the ranks' shards or the agreed fields of their ``spec``
    differ; a no-op for a configuration the group has agreed on before, for a world of one, and while a
    graph is being captured (the check reads its result on the host; the eager warm-up call before a
    capture makes it). ``alibi_slopes``: the call's, where ``spec`` does not carry them (a RingConfig does)."""
    if comm.size() == 1 or backend.is_capturing():
        return
    s = spec
    slopes = alibi_slopes if alibi_slopes is not None else getattr(spec, "alibi_slopes", None)
    values = fingerprint(q, k, v, s.causal, s.balance, s.scale, s.documents, sinks, s.window, s.ulysses, s.softcap,
                         slopes, s.chunk)  # fmt: skip
    agree(comm, backend, values, q.device)


def agree(comm: Any, backend: Any, values: Any, device: torch.device, key: tuple | None = None) -> None:
    """Raise a ValueError on every rank when the ranks' fingerprints ``values`` (see :func:`fingerprint`)
    differ; a no-op for a configuration the group has agreed on before. Every rank of the group calls it.

    :param values: the fingerprint, or a function that makes it (called only when the check runs).
    :param key: what the group remembers as agreed, where it is not the fingerprint itself (the KV cache
        compares its global length on the first call of a configuration, and leaves it out of the key).
    """
    agreed = agreed_set(comm)
    if (values if key is None else key) in agreed:
        return
    if callable(values):
        values = values()
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = ring_gather(comm, backend, mine)
    message = disagreement(rows)
    if message is not None:
        raise ValueError(message)
    if len(agreed) >= MAX_AGREED:
        agreed.clear()
    agreed.add(values if key is None else key)
