"""The ring as torch.library custom ops, so that ``torch.compile(fullgraph=True)`` sees one opaque call.

Inside a compiled region :func:`xcp.attention` checks what it can trace and calls ``xcp::ring_forward``;
the group travels by name, as PyTorch's functional collectives pass it (``""`` for no group: the default
process group when one is initialised, else a world of one), and the backend by its registered name. The
op resolves both, builds the :class:`~xcp.ring.RingConfig` and runs :func:`~xcp.ring.ring_forward`
eagerly; its fake implementation gives the output shapes, and its autograd formula calls
``xcp::ring_backward``. Nothing in the traced part takes a lock or reads a thread id.

LocalWorld groups are threads of one process; a compiled graph cannot name them, so they stay eager
(:func:`group_name` says so).
"""

from __future__ import annotations

from typing import Any

import torch

from .kernels.merge import accumulator_dtype, sinks_grad

_NO_WINDOW: list[int] = []


def group_name(group: Any) -> str:
    """The name a compiled call passes for ``group``: ``""`` for None, the process group's registered name
    for a torch.distributed group; a ValueError for what a graph cannot name (a LocalWorld group)."""
    if group is None:
        return ""
    import torch.distributed as dist

    from .comm import process_group_of_mesh

    mesh_group = process_group_of_mesh(group)
    if mesh_group is not None:
        return mesh_group.group_name
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    raise ValueError(
        f"group: torch.compile needs a torch.distributed ProcessGroup, a 1-D DeviceMesh or None; got "
        f"{type(group).__name__} "
        "(LocalWorld ranks are threads of one process, which a compiled graph cannot name: call xcp.attention "
        "outside torch.compile there)"
    )


def _config(q: torch.Tensor, group: str, backend: str, causal: bool, scale: float, balance: str, slots: str,
            handoff: str, documents: list[int] | None, window: list[int], timeout: float):  # fmt: skip
    """The RingConfig the named arguments stand for, with the checks :func:`xcp.attention` makes on
    the group, the backend and the documents (which a trace could not make)."""
    from .api import check_backend_serves, check_documents
    from .comm import DistCommunicator, resolve_group
    from .plugins import select_backend
    from .ring import RingConfig

    if group:
        from torch.distributed.distributed_c10d import _resolve_process_group

        comm = DistCommunicator(_resolve_process_group(group), None if timeout < 0 else timeout)
    else:
        comm = resolve_group(None, None if timeout < 0 else timeout)
    win = None if not window else tuple(None if w < 0 else w for w in window)
    be = select_backend(backend or None, q.device.type)
    check_backend_serves(be, q, comm, causal, balance)
    docs = check_documents(documents, q, comm.size(), balance, win)
    return RingConfig(comm, be, causal, scale, balance, slots, handoff or None, docs, win)


@torch.library.custom_op("xcp::ring_forward", mutates_args=())
def ring_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    group: str,
    backend: str,
    causal: bool,
    scale: float,
    balance: str,
    slots: str,
    handoff: str,
    documents: list[int] | None,
    window: list[int],
    timeout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of this rank: :func:`xcp.ring.ring_forward` on the named group and backend."""
    from .ring import ring_forward

    cfg = _config(q, group, backend, causal, scale, balance, slots, handoff, documents, window, timeout)
    out, lse = ring_forward(q, k, v, cfg, sinks)
    return out, lse


@ring_forward_op.register_fake
def _(q, k, v, sinks, group, backend, causal, scale, balance, slots, handoff, documents, window, timeout):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=accumulator_dtype(q.dtype))


@torch.library.custom_op("xcp::ring_backward", mutates_args=())
def ring_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: str,
    backend: str,
    causal: bool,
    scale: float,
    balance: str,
    slots: str,
    handoff: str,
    documents: list[int] | None,
    window: list[int],
    timeout: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this rank: :func:`xcp.ring.ring_backward` on the named group and backend."""
    from .ring import ring_backward

    cfg = _config(q, group, backend, causal, scale, balance, slots, handoff, documents, window, timeout)
    return ring_backward(dout.contiguous(), q, k, v, out, lse, cfg)


@ring_backward_op.register_fake
def _(dout, q, k, v, out, lse, group, backend, causal, scale, balance, slots, handoff, documents, window, timeout):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_OPTIONS = ("group", "backend", "causal", "scale", "balance", "slots", "handoff", "documents", "window", "timeout")


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.options = options


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dq, dk, dv = ring_backward_op(dout, q, k, v, out, lse, *ctx.options)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[3]:
        dsinks = sinks_grad(dout, out, lse, sinks)
    return (dq, dk, dv, dsinks) + (None,) * len(_OPTIONS)


ring_forward_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(q, k, v, sinks, group: Any, device: Any, causal: bool, scale: float, balance: str,
                       slots: str, handoff: str | None, cu_seqlens: Any, window: Any,
                       timeout: float | None = None) -> torch.Tensor:  # fmt: skip
    """What :func:`xcp.attention` calls inside a compiled region (its arguments checked as far as a trace
    can; the rest, such as the documents' boundaries, inside the op)."""
    documents = None
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, torch.Tensor):
            raise ValueError(
                "cu_seqlens: under torch.compile pass the boundaries as a list of ints (a tensor would be read "
                "on the host inside the graph); got a tensor"
            )
        documents = [int(x) for x in cu_seqlens]
    win = _NO_WINDOW if window is None else [-1 if w is None else int(w) for w in window]
    name = group_name(group)
    out, _ = ring_forward_op(
        q, k, v, sinks, name, "" if device is None else str(device), causal, scale, balance, slots, handoff or "",
        documents, win, -1.0 if timeout is None else float(timeout),
    )  # fmt: skip
    return out
