"""The plugin manager, entry-point discovery, the backend table and backend selection.

One pluggy ``PluginManager`` (project ``xcp``) holds every plugin: the built-in CPU plugin
(:mod:`xcp.backends.cpu`), the plugins of installed distributions under the entry-point group ``xcp``
(unless ``XCP_DISABLE_PLUGIN_AUTOLOAD=1``), and whatever :func:`register_plugin` adds. The backend table is
built lazily by calling each plugin's ``xcp_register_backends`` hook on its own, so that a plugin that
fails to import or whose hook raises is reported by name while every other backend keeps working.
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pluggy

from . import hookspecs, settings
from .backends import cpu
from .backends.base import Backend, check_backend


class PluginWarning(UserWarning):
    """A plugin failed to load or to register its backends; the others still work."""


class BackendError(RuntimeError):
    """A backend that was asked for is unknown, unusable here or registered twice."""


class BackendRow(NamedTuple):
    """One row of :func:`backend_table` (what ``xcp backends`` prints)."""

    name: str
    device_type: str
    dist_backend: str
    handoff_policy: str
    kernel: str
    available: bool
    reason: str
    plugin: str


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be imported (``stage="load"``) or whose hook raised (``"register"``)."""

    plugin: str
    stage: str
    error: str

    def describe(self) -> str:
        return f"plugin {self.plugin!r} failed to {self.stage}: {self.error}"


@dataclass
class _Registry:
    """The result of calling every plugin's hook once: backends in registration order and failures."""

    entries: list[tuple[Backend, str]] = field(default_factory=list)  # (backend, plugin name)
    failures: list[PluginFailure] = field(default_factory=list)
    selected: dict[str, Backend] = field(default_factory=dict)  # select_backend's answers, by the value asked

    def owners(self, name: str) -> list[str]:
        return [plugin for backend, plugin in self.entries if backend.name == name]

    def find(self, name: str) -> Backend | None:
        return next((backend for backend, _ in self.entries if backend.name == name), None)


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_load_failures: list[PluginFailure] = []
_registry: _Registry | None = None


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _warn(failure: PluginFailure) -> None:
    warnings.warn(f"xcp: {failure.describe()}", PluginWarning, stacklevel=3)


def _entry_points() -> Iterable[Any]:
    """The entry points of group ``xcp`` of the installed distributions."""
    return importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)


def _load_entry_points(pm: pluggy.PluginManager) -> list[PluginFailure]:
    """Import and register each entry-point plugin; return those that failed to import.

    Unlike pluggy's ``load_setuptools_entrypoints``, which stops at the first plugin that fails to
    import, a failure here is recorded under the plugin's name and loading goes on. A plugin that imports
    but does not validate (a hook with wrong arguments) still raises: that is a bug for its author.
    """
    failures = []
    for ep in _entry_points():
        if pm.is_blocked(ep.name):
            continue
        if pm.has_plugin(ep.name):
            failures.append(PluginFailure(ep.name, "load", f"the plugin name {ep.name!r} is taken by another plugin"))
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - reported by name; discovery goes on
            failures.append(PluginFailure(ep.name, "load", _describe_error(exc)))
            continue
        pm.register(plugin, name=ep.name)
    return failures


def get_plugin_manager() -> pluggy.PluginManager:
    """The one plugin manager of xcp, created on first use.

    Creating it adds the hook specifications, registers the built-in CPU plugin, loads the entry-point
    plugins unless ``XCP_DISABLE_PLUGIN_AUTOLOAD`` is set, and runs ``check_pending()`` so that a hook
    whose name matches no specification (a misspelling) raises :class:`pluggy.PluginValidationError`.
    """
    global _manager, _load_failures
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT)
            pm.add_hookspecs(hookspecs)
            pm.register(cpu, name="cpu")
            failures = [] if settings.DISABLE_PLUGIN_AUTOLOAD.read() else _load_entry_points(pm)
            pm.check_pending()
            for failure in failures:
                _warn(failure)
            _manager, _load_failures = pm, failures
        return _manager


def reload_plugins() -> None:
    """Forget the plugin manager and the backend table; the next call discovers the plugins again
    (after installing a plugin in a running session, or after changing ``XCP_DISABLE_PLUGIN_AUTOLOAD``)."""
    global _manager, _load_failures, _registry
    with _lock:
        _manager, _load_failures, _registry = None, [], None


def _call_hooks(pm: pluggy.PluginManager) -> _Registry:
    """Call each plugin's ``xcp_register_backends`` on its own, so one plugin's error stays its own."""
    registry = _Registry(failures=list(_load_failures))
    for impl in pm.hook.xcp_register_backends.get_hookimpls():
        got: list[Backend] = []

        def register(backend: Backend, got: list[Backend] = got) -> None:
            got.append(check_backend(backend))

        kwargs = {"register": register}
        try:
            impl.function(*(kwargs[arg] for arg in impl.argnames))
        except Exception as exc:  # noqa: BLE001 - reported by name; the other plugins go on
            failure = PluginFailure(impl.plugin_name, "register", _describe_error(exc))
            registry.failures.append(failure)
            _warn(failure)
            continue
        registry.entries.extend((backend, impl.plugin_name) for backend in got)
    for name in dict.fromkeys(backend.name for backend, _ in registry.entries):
        owners = registry.owners(name)
        if len(owners) > 1:
            warnings.warn(f"xcp: {_duplicate_text(name, owners)}", PluginWarning, stacklevel=3)
    return registry


def _duplicate_text(name: str, owners: list[str]) -> str:
    plugins = " and ".join(repr(p) for p in owners)
    return f"backend name {name!r} is registered by plugins {plugins}; uninstall or unregister one of them"


def _get_registry() -> _Registry:
    global _registry
    with _lock:
        pm = get_plugin_manager()
        if _registry is None:
            _registry = _call_hooks(pm)
        return _registry


def _invalidate() -> None:
    global _registry
    with _lock:
        _registry = None


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register ``plugin`` (a module or object with ``@xcp.hookimpl`` functions); return its name.

    :raises pluggy.PluginValidationError: a hook of ``plugin`` matches no specification or has wrong
        arguments; ``plugin`` is then not registered.
    :raises ValueError: ``plugin`` or its name is already registered, or it registers a backend name
        that another plugin already registered (the message names both); ``plugin`` is then not
        registered.
    """
    with _lock:
        pm = get_plugin_manager()
        plugin_name = pm.register(plugin, name)
        if plugin_name is None:
            raise ValueError(f"name: the plugin name {name!r} is blocked")
        try:
            pm.check_pending()
        except pluggy.PluginValidationError:
            pm.unregister(plugin)
            raise
        _invalidate()
        registry = _get_registry()
        clashes = [b.name for b, p in registry.entries if p == plugin_name and len(registry.owners(b.name)) > 1]
        if clashes:
            pm.unregister(plugin)
            _invalidate()
            raise ValueError(_duplicate_text(clashes[0], registry.owners(clashes[0])))
        return plugin_name


def unregister_plugin(plugin: object) -> None:
    """Unregister ``plugin`` (the object, or its name) and forget the backends it registered."""
    with _lock:
        pm = get_plugin_manager()
        if isinstance(plugin, str):
            pm.unregister(name=plugin)
        else:
            pm.unregister(plugin)
        _invalidate()


def _availability(backend: Backend) -> tuple[bool, str]:
    """``backend.available()``, with an exception or a malformed answer turned into a reason."""
    try:
        answer = backend.available()
    except Exception as exc:  # noqa: BLE001 - the table must show every backend
        return False, f"available() raised {_describe_error(exc)}"
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool)):
        return False, f"available() returned {answer!r}; expected a (bool, str) tuple"
    ok, reason = answer
    return ok, "" if ok else (str(reason) or "unavailable (no reason given)")


def backend_table() -> list[BackendRow]:
    """Every installed backend and every plugin that failed, with whether each is usable and why not."""
    registry = _get_registry()
    rows = []
    for backend, plugin in registry.entries:
        owners = registry.owners(backend.name)
        if len(owners) > 1:
            ok, reason = False, _duplicate_text(backend.name, owners)
        else:
            ok, reason = _availability(backend)
        rows.append(
            BackendRow(
                backend.name,
                backend.device_type,
                backend.dist_backend,
                backend.handoff_policy,
                backend.kernel,
                ok,
                reason,
                plugin,
            )
        )
    for failure in registry.failures:
        rows.append(BackendRow(failure.plugin, "-", "-", "-", "-", False, failure.describe(), failure.plugin))
    return rows


def _installed_text(rows: list[BackendRow]) -> str:
    lines = []
    for row in rows:
        status = "available" if row.available else row.reason
        origin = "" if row.plugin == row.name else f" [plugin {row.plugin}]"
        lines.append(f"  {row.name}: {status}{origin}")
    return "installed backends:\n" + ("\n".join(lines) if lines else "  (none)")


def list_backends() -> list[Backend]:
    """Every registered backend, available or not, in registration order."""
    return [backend for backend, _ in _get_registry().entries]


def get_backend(name: str) -> Backend:
    """The backend called ``name``.

    :raises BackendError: (a RuntimeError) when it is unknown, unusable here or registered by two
        plugins; the message lists every installed backend and why each is or is not usable.
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a backend name (str); got {type(name).__name__}")
    registry = _get_registry()
    backend = registry.find(name)
    owners = registry.owners(name)
    failed = next((f for f in registry.failures if f.plugin == name), None)
    if backend is None:
        what = f"not usable here: {failed.describe()}" if failed else "unknown"
    elif len(owners) > 1:
        what = "ambiguous: " + _duplicate_text(name, owners)
    else:
        ok, reason = _availability(backend)
        if ok:
            return backend
        what = f"not usable here: {reason}"
    raise BackendError(f"backend {name!r} is {what}\n{_installed_text(backend_table())}")


def _resolve(name: str) -> Backend:
    """A backend by name, else the one available backend whose device type is ``name``."""
    registry = _get_registry()
    if registry.find(name) is None:
        same_type = [b for b, _ in registry.entries if b.device_type == name and _availability(b)[0]]
        if len(same_type) == 1:
            return same_type[0]
    return get_backend(name)


def select_backend(device: str | None, tensor_device_type: str | None) -> Backend:
    """The backend for a call: the explicit ``device`` (a backend name or device type, an index such as
    ``cuda:1`` ignored), else the tensors' device type, else ``XCP_DEVICE``, else ``cpu``.

    :raises BackendError: naming where the choice came from, with the table of installed backends.
    """
    registry = _registry  # a call per attention: answer from this registry's memory when it can
    asked = device or tensor_device_type
    if registry is not None and asked:
        known = registry.selected.get(asked)
        if known is not None:
            return known
    choices = (
        ("device", device),
        ("tensors' device type", tensor_device_type),
        (settings.DEVICE.name, settings.DEVICE.read()),
        ("default", "cpu"),
    )
    source, value = next((source, value) for source, value in choices if value)
    try:
        backend = _resolve(str(value).split(":")[0])
    except BackendError as exc:
        raise BackendError(f"{source}={value!r}: {exc}") from None
    if registry is not None and registry is _registry and value == asked:  # only usable backends are kept
        registry.selected[str(value)] = backend
    return backend
