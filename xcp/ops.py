"""The ring as torch.library custom ops, so that ``torch.compile(fullgraph=True)`` sees one opaque call.

Inside a compiled region :func:`xcp.attention` checks what it can trace and calls ``xcp::ring_forward``;
the group travels by name, as PyTorch's functional collectives pass it (``""`` for no group: the default
process group when one is initialised, else a world of one), and the backend by its registered name. The
op resolves both, builds the :class:`~xcp.ring.RingConfig` and runs :func:`~xcp.ring.ring_forward`
eagerly; its fake implementation gives the output shapes, and its autograd formula calls
``xcp::ring_backward``, which also takes the gradient of lse (None where lse is unused) and raises when it
is not zero (``return_lse=True``: gradients through lse are not supported). Nothing in the traced part takes
a lock or reads a thread id.

LocalWorld groups are threads of one process; a compiled graph cannot name them, so they stay eager
(:func:`group_name` says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .checks import check_backend_serves, check_backend_variants, check_documents
from .comm import Communicator, DistCommunicator, process_group_of_mesh, resolve_group
from .kernels.merge import accumulator_dtype, sinks_grad
from .plugins import select_backend
from .ring import RingConfig, check_lse_grad, once_differentiable, ring_backward, ring_forward
from .spec import spec_fields


def _same(x: Any) -> Any:
    return x


def _window_to_op(window: Any) -> list[int]:
    return [] if window is None else [-1 if w is None else int(w) for w in window]


def _window_from_op(window: list[int]) -> tuple[int | None, int | None] | None:
    return None if not window else (None if window[0] < 0 else window[0], None if window[1] < 0 else window[1])


def _documents_to_op(documents: Any) -> list[int] | None:
    if documents is None:
        return None
    if isinstance(documents, torch.Tensor):
        raise ValueError(
            "cu_seqlens: under torch.compile pass the boundaries as a list of ints (a tensor would be read "
            "on the host inside the graph); got a tensor"
        )
    return [int(x) for x in documents]


_TRAVEL: dict[str, tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    "bool": ("bool", _same, _same),
    "float": ("float", float, _same),
    "int": ("int", int, _same),
    "str": ("str", _same, _same),
    "str | None": ("str?", _same, _same),
    "float | None": ("float?", _same, _same),
    "int | None": ("int?", _same, _same),
    "tuple[int, ...] | None": ("int[]?", _documents_to_op, _same),
    "tuple[int | None, int | None] | None": ("int[]", _window_to_op, _window_from_op),
}
"""How a field of :class:`~xcp.spec.CallSpec` travels through the op's schema, by the field's type: the
schema's type, the conversion into the op and the one back (the documents come back as the caller's list,
checked inside the op, where the group's size is known)."""


def _travel(field: Any) -> tuple[str, Callable[[Any], Any], Callable[[Any], Any]]:
    kind = _TRAVEL.get(str(field.type))
    if kind is None:
        raise TypeError(f"CallSpec.{field.name}: expected a type the op's schema can carry; got {field.type}")
    return kind


_SPEC = tuple((f.name, *_travel(f)) for f in spec_fields())
"""(name, schema type, into the op, back) of each field of the spec, in the spec's order."""
_SPEC_SCHEMA = ", ".join(f"{kind} {name}" for name, kind, _, _ in _SPEC)
_WHERE = "str group, str backend, float timeout"


def group_name(group: Any) -> str:
    """The name a compiled call passes for ``group``: ``""`` for None, the process group's registered name
    for a torch.distributed group; a ValueError for what a graph cannot name (a LocalWorld group)."""
    if group is None:
        return ""
    import torch.distributed as dist

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


def _config(
    q: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor | None, group: str, backend: str, timeout: float, spec: tuple
) -> RingConfig:
    """The RingConfig the op's arguments stand for (``spec``: the spec's fields as the op carries them), with
    the checks :func:`xcp.attention` makes on the group, the backend and the documents (which a trace could
    not make)."""
    comm: Communicator
    if group:
        from torch.distributed.distributed_c10d import _resolve_process_group

        comm = DistCommunicator(_resolve_process_group(group), None if timeout < 0 else timeout)  # type: ignore[arg-type]  # a GroupName is a str
    else:
        comm = resolve_group(None, None if timeout < 0 else timeout)
    fields = {name: back(value) for (name, _, _, back), value in zip(_SPEC, spec)}
    be = select_backend(backend or None, q.device.type)
    check_backend_serves(be, q, comm.size(), fields["causal"], fields["balance"], value_dim=v.shape[3])
    check_backend_variants(be, fields["softcap"], slopes)
    fields["documents"] = check_documents(
        fields["documents"], q, comm.size(), fields["balance"], fields["window"], rank=comm.rank(),
        chunk=fields["chunk"],
    )  # fmt: skip
    return RingConfig(comm, be, alibi_slopes=slopes, **fields)


def _ring_forward(q, k, v, sinks, alibi_slopes, group, backend, timeout, *spec):
    """``(out, lse)`` of this rank: :func:`xcp.ring.ring_forward` on the named group and backend."""
    return ring_forward(q, k, v, _config(q, v, alibi_slopes, group, backend, timeout, spec), sinks)


def _ring_backward(dout, q, k, v, out, lse, dlse, alibi_slopes, group, backend, timeout, *spec):
    """``(dq, dk, dv)`` of this rank: :func:`xcp.ring.ring_backward` on the named group and backend, after
    :func:`xcp.ring.check_lse_grad` of ``dlse``, the gradient of lse or None (here, at run time: a trace
    cannot read values)."""
    check_lse_grad(dlse)
    cfg = _config(q, v, alibi_slopes, group, backend, timeout, spec)
    return ring_backward(dout.contiguous(), q, k, v, out, lse, cfg)


ring_forward_op = torch.library.custom_op(
    "xcp::ring_forward",
    _ring_forward,
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? alibi_slopes, {_WHERE}, {_SPEC_SCHEMA}) -> "
    "(Tensor, Tensor)",
)
ring_backward_op = torch.library.custom_op(
    "xcp::ring_backward",
    _ring_backward,
    mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor? alibi_slopes, "
    f"{_WHERE}, {_SPEC_SCHEMA}) -> (Tensor, Tensor, Tensor)",
)


@ring_forward_op.register_fake
def _(q, k, v, *options):
    b, s, h, _ = q.shape  # out has the values' head dim
    return q.new_empty((b, s, h, v.shape[3])), q.new_empty((b, h, s), dtype=accumulator_dtype(q.dtype))


@ring_backward_op.register_fake
def _(dout, q, k, v, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, *options = inputs  # options: the slopes, the group and backend, the spec
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.options = options
    ctx.set_materialize_grads(False)  # an unused lse gives None: nothing to check


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    if dout is None and dlse is None:
        return (None,) * (4 + len(ctx.options))
    with torch.no_grad():
        if dout is None:  # only lse's gradient came: the op checks it (zeros add nothing)
            dout = torch.zeros_like(out)
        dq, dk, dv = ring_backward_op(dout, q, k, v, out, lse, dlse, *ctx.options)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sinks_grad(dout, out, lse, sinks)
    return (*once_differentiable((dq, dk, dv, dsinks), (q, k, v, sinks, dout)), *(None,) * len(ctx.options))


ring_forward_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, group: Any, device: Any,
    timeout: float | None, alibi_slopes: torch.Tensor | None = None, **spec: Any,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """What :func:`xcp.attention` calls inside a compiled region: ``spec``, the fields of a
    :class:`~xcp.spec.CallSpec` by name (``documents`` the caller's ``cu_seqlens``), checked as far as a
    trace can; the rest, such as the documents' boundaries, inside the op. Returns ``(out, lse)``."""
    values = [to_op(spec[name]) for name, _, to_op, _ in _SPEC]
    where = (group_name(group), "" if device is None else str(device), -1.0 if timeout is None else float(timeout))
    return ring_forward_op(q, k, v, sinks, alibi_slopes, *where, *values)
