"""Backend registry and selection (the pluggy plugin manager arrives with the backends issue)."""

from __future__ import annotations

import os

from .backend import Backend
from .cpu import CPUBackend

_BACKENDS: dict[str, Backend] = {"cpu": CPUBackend()}


def list_backends() -> list[Backend]:
    """Every registered backend, available or not."""
    return list(_BACKENDS.values())


def get_backend(name: str) -> Backend:
    """The backend called ``name``; raise a RuntimeError listing what is installed when it is unknown or
    unusable here."""
    backend = _BACKENDS.get(name)
    if backend is not None:
        ok, reason = backend.available()
        if ok:
            return backend
    rows = []
    for b in _BACKENDS.values():
        ok, why = b.available()
        rows.append(f"  {b.name}: {'available' if ok else why}")
    what = "unknown" if backend is None else "not usable here"
    raise RuntimeError(f"device: backend {name!r} is {what}; installed backends:\n" + "\n".join(rows))


def select_backend(device: str | None, tensor_device_type: str | None) -> Backend:
    """Explicit ``device`` first, then the tensors' device type, then ``XCP_DEVICE``, then cpu."""
    name = device or tensor_device_type or os.environ.get("XCP_DEVICE") or "cpu"
    return get_backend(str(name).split(":")[0])


# TEMP shim: replaced by the plugin manager on merge
_PLUGIN_BACKENDS: dict[int, list[str]] = {}


def register_plugin(obj: object, name: str | None = None) -> None:
    """Register the backends of a plugin object (calls its ``xcp_register_backends`` hook)."""
    names: list[str] = []

    def register(backend: Backend) -> None:
        if backend.name in _BACKENDS:
            raise ValueError(f"backend {backend.name!r} is already registered")
        _BACKENDS[backend.name] = backend
        names.append(backend.name)

    hook = getattr(obj, "xcp_register_backends", None)
    if hook is not None:
        hook(register=register)
    _PLUGIN_BACKENDS[id(obj)] = names


def unregister_plugin(obj: object) -> None:
    """Remove the backends that :func:`register_plugin` registered for ``obj``."""
    for backend_name in _PLUGIN_BACKENDS.pop(id(obj), []):
        _BACKENDS.pop(backend_name, None)
