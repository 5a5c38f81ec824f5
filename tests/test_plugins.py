"""The plugin system: registration, discovery, failures reported by name, and backend selection."""

from __future__ import annotations

import types

import pluggy
import pytest
import torch

import xcp
from xcp import plugins, settings
from xcp.backends.base import check_backend
from xcp.backends.cpu import CPUBackend
from xcp.backends.fused import FusedKernelBackend


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    """Each test starts from a newly discovered plugin manager and leaves none behind."""
    monkeypatch.delenv(settings.DISABLE_PLUGIN_AUTOLOAD.name, raising=False)
    monkeypatch.delenv(settings.DEVICE.name, raising=False)
    plugins.reload_plugins()
    yield
    plugins.reload_plugins()


def backend_class(name: str, device_type: str = "cpu", why_not: str = "") -> type[CPUBackend]:
    """A CPU-kernel backend called ``name``; unavailable with reason ``why_not`` when that is set."""

    def available(self):
        return (False, why_not) if why_not else (True, "")

    return type(f"Fake_{name}", (CPUBackend,), {"name": name, "device_type": device_type, "available": available})


def plugin_for(*backends: xcp.Backend) -> object:
    """A plugin object whose hook registers ``backends``."""

    class Plugin:
        @xcp.hookimpl
        def xcp_register_backends(self, register):
            for b in backends:
                register(b)

    return Plugin()


class FakeEntryPoint:
    """Stands for an importlib.metadata.EntryPoint of group ``xcp``."""

    def __init__(self, name: str, plugin: object = None, error: BaseException | None = None) -> None:
        self.name, self._plugin, self._error = name, plugin, error
        self.loads = 0

    def load(self) -> object:
        self.loads += 1
        if self._error is not None:
            raise self._error
        return self._plugin


def use_entry_points(monkeypatch, *eps: FakeEntryPoint) -> None:
    monkeypatch.setattr(plugins, "_entry_points", lambda: list(eps))
    plugins.reload_plugins()


# ------------------------------------------------------------------------------- built-ins and registration


def test_builtin_cpu_is_a_plugin_like_any_other():
    pm = plugins.get_plugin_manager()
    assert pm is plugins.get_plugin_manager()  # one manager
    assert pm.get_plugin("cpu") is xcp.backends.cpu
    impls = pm.hook.xcp_register_backends.get_hookimpls()
    assert [i.plugin_name for i in impls][0] == "cpu"
    row = next(r for r in xcp.backend_table() if r.name == "cpu")
    assert row == ("cpu", "cpu", "gloo", "none", CPUBackend.kernel, True, "", "cpu")
    assert isinstance(xcp.get_backend("cpu"), CPUBackend)


def test_register_and_unregister_a_plugin_object():
    plugin = plugin_for(backend_class("extra")())
    assert xcp.register_plugin(plugin, name="extra-plugin") == "extra-plugin"
    try:
        assert xcp.get_backend("extra").name == "extra"
        assert "extra" in [b.name for b in xcp.list_backends()]
        row = next(r for r in xcp.backend_table() if r.name == "extra")
        assert row.plugin == "extra-plugin" and row.available
    finally:
        xcp.unregister_plugin(plugin)
    assert "extra" not in [b.name for b in xcp.list_backends()]
    with pytest.raises(RuntimeError, match="backend 'extra' is unknown"):
        xcp.get_backend("extra")


def test_register_a_module_and_unregister_it_by_name():
    module = types.ModuleType("vendor_plugin")

    @xcp.hookimpl
    def xcp_register_backends(register):
        register(backend_class("vendor")())

    module.xcp_register_backends = xcp_register_backends
    name = xcp.register_plugin(module)
    try:
        assert name == "vendor_plugin"
        assert xcp.get_backend("vendor").name == "vendor"
    finally:
        xcp.unregister_plugin("vendor_plugin")
    assert "vendor" not in [b.name for b in xcp.list_backends()]


def test_a_plugin_cannot_be_registered_twice():
    plugin = plugin_for(backend_class("once")())
    xcp.register_plugin(plugin)
    try:
        with pytest.raises(ValueError, match="already registered"):
            xcp.register_plugin(plugin)
    finally:
        xcp.unregister_plugin(plugin)


# ------------------------------------------------------------------------------- duplicates


def test_duplicate_backend_name_from_register_plugin_names_both_plugins():
    plugin = plugin_for(backend_class("cpu")())
    with pytest.warns(plugins.PluginWarning), pytest.raises(ValueError) as err:
        xcp.register_plugin(plugin, name="impostor")
    assert "'cpu' and 'impostor'" in str(err.value)
    assert not plugins.get_plugin_manager().is_registered(plugin)
    assert isinstance(xcp.get_backend("cpu"), CPUBackend)  # the built-in still serves


def test_duplicate_backend_name_from_entry_points_is_an_error_naming_both(monkeypatch):
    twin = backend_class("twin")
    use_entry_points(
        monkeypatch, FakeEntryPoint("first", plugin_for(twin())), FakeEntryPoint("second", plugin_for(twin()))
    )
    with pytest.warns(plugins.PluginWarning, match="'twin' is registered by plugins 'first' and 'second'"):
        table = xcp.backend_table()
    rows = [r for r in table if r.name == "twin"]
    assert [r.plugin for r in rows] == ["first", "second"]
    assert not any(r.available for r in rows)
    with pytest.raises(RuntimeError, match="ambiguous.*'first' and 'second'"):
        xcp.get_backend("twin")
    assert isinstance(xcp.get_backend("cpu"), CPUBackend)


# ------------------------------------------------------------------------------- failing plugins


def test_plugin_whose_hook_raises_is_reported_by_name_and_others_work():
    class Broken:
        @xcp.hookimpl
        def xcp_register_backends(self, register):
            register(backend_class("half")())  # registered before the error: dropped with the plugin
            raise RuntimeError("driver exploded")

    good = plugin_for(backend_class("good")())
    xcp.register_plugin(good, name="good-plugin")
    try:
        with pytest.warns(
            plugins.PluginWarning, match="plugin 'broken' failed to register: RuntimeError: driver exploded"
        ):
            xcp.register_plugin(Broken(), name="broken")
        row = next(r for r in xcp.backend_table() if r.plugin == "broken")
        assert not row.available and "driver exploded" in row.reason
        assert xcp.get_backend("good").name == "good"
        assert isinstance(xcp.get_backend("cpu"), CPUBackend)
        with pytest.raises(RuntimeError) as err:
            xcp.get_backend("half")
        assert "broken: plugin 'broken' failed to register: RuntimeError: driver exploded" in str(err.value)
    finally:
        xcp.unregister_plugin("broken")
        xcp.unregister_plugin(good)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (object(), "expected an instance of xcp.Backend; got object"),
        (type("NoHandoff", (CPUBackend,), {"name": "nh", "handoff_policy": "teleport"})(), "backend.handoff_policy"),
        (type("Spaced", (CPUBackend,), {"name": "a b"})(), "backend.name"),
        (type("NoDtypes", (CPUBackend,), {"name": "nd", "dtypes": ()})(), "backend.dtypes"),
        (type("NoNone", (CPUBackend,), {"name": "nn", "masks": ("causal",)})(), "backend.masks"),
    ],
)
def test_malformed_backend_is_reported_by_its_plugin(bad, message):
    with pytest.warns(plugins.PluginWarning, match=f"plugin 'sloppy' failed to register: .*{message}"):
        xcp.register_plugin(plugin_for(bad), name="sloppy")
    assert any(r.plugin == "sloppy" and message in r.reason for r in xcp.backend_table())
    assert isinstance(xcp.get_backend("cpu"), CPUBackend)


def test_entry_point_that_fails_to_import_is_reported_by_name(monkeypatch):
    missing = FakeEntryPoint("npu-like", error=ImportError("libhccl.so: cannot open shared object file"))
    fine = FakeEntryPoint("fine", plugin_for(backend_class("fine")()))
    with pytest.warns(plugins.PluginWarning, match="plugin 'npu-like' failed to load: ImportError: libhccl.so"):
        use_entry_points(monkeypatch, missing, fine)
        plugins.get_plugin_manager()
    assert xcp.get_backend("fine").name == "fine"
    with pytest.raises(RuntimeError) as err:
        xcp.get_backend("npu-like")
    text = str(err.value)
    assert "backend 'npu-like' is not usable here: plugin 'npu-like' failed to load" in text
    assert "  cpu: available" in text and "  fine: available" in text


def test_available_that_raises_is_reported_not_propagated():
    class Flaky(CPUBackend):
        name = "flaky"

        def available(self):
            raise OSError("driver probe failed")

    xcp.register_plugin(plugin_for(Flaky()), name="flaky")
    try:
        row = next(r for r in xcp.backend_table() if r.name == "flaky")
        assert not row.available and row.reason == "available() raised OSError: driver probe failed"
    finally:
        xcp.unregister_plugin("flaky")


def test_backend_class_lacking_required_methods_is_refused_at_registration():
    class Half(xcp.SynchronousBackend):  # forgot backward
        name = "half"

        def forward(self, q, k, v, mask, scale):
            return q, q

    class Empty(FusedKernelBackend):  # a fused-op backend that wrote neither square kernel
        name = "empty"

    with pytest.warns(plugins.PluginWarning):
        xcp.register_plugin(plugin_for(Half(), backend_class("kept")()), name="halfplugin")
    try:
        rows = {r.name: r for r in xcp.backend_table()}
        assert "half" not in rows and "kept" not in rows  # the plugin's backends are dropped together
        assert rows["halfplugin"].reason == (
            "plugin 'halfplugin' failed to register: TypeError: backend class Half lacks the required methods backward"
        )
    finally:
        xcp.unregister_plugin("halfplugin")
    with pytest.raises(TypeError, match="class Empty lacks the required methods square_backward, square_forward"):
        check_backend(Empty())


# ------------------------------------------------------------------------------- misspelled hooks


def test_misspelled_hook_fails_loudly_and_is_not_registered():
    class Typo:
        @xcp.hookimpl
        def xcp_register_backend(self, register):  # missing "s"
            register(backend_class("never")())

    typo = Typo()
    with pytest.raises(pluggy.PluginValidationError, match="xcp_register_backend"):
        xcp.register_plugin(typo, name="typo")
    assert not plugins.get_plugin_manager().is_registered(typo)


def test_hook_with_wrong_arguments_fails_loudly():
    class WrongArgs:
        @xcp.hookimpl
        def xcp_register_backends(self, registrar):
            pass

    with pytest.raises(pluggy.PluginValidationError, match="registrar"):
        xcp.register_plugin(WrongArgs(), name="wrong-args")


def test_misspelled_hook_in_an_entry_point_plugin_fails_discovery(monkeypatch):
    module = types.ModuleType("typo_plugin")
    module.xcp_regster_backends = xcp.hookimpl(lambda register: None)
    use_entry_points(monkeypatch, FakeEntryPoint("typo", module))
    with pytest.raises(pluggy.PluginValidationError, match="xcp_regster_backends"):
        plugins.get_plugin_manager()


# ------------------------------------------------------------------------------- autoload


def test_disable_autoload_skips_entry_points(monkeypatch):
    ep = FakeEntryPoint("auto", plugin_for(backend_class("auto")()))
    use_entry_points(monkeypatch, ep)
    monkeypatch.setenv(settings.DISABLE_PLUGIN_AUTOLOAD.name, "1")
    assert [r.plugin for r in xcp.backend_table()] == ["cpu"]
    assert ep.loads == 0
    with pytest.raises(RuntimeError, match="'auto' is unknown"):
        xcp.get_backend("auto")
    monkeypatch.setenv(settings.DISABLE_PLUGIN_AUTOLOAD.name, "0")
    plugins.reload_plugins()
    assert xcp.get_backend("auto").name == "auto" and ep.loads == 1


def test_real_entry_points_of_the_xcp_distribution_are_discovered(monkeypatch):
    """pyproject.toml declares cuda and npu; each shows up, as a backend or as a plugin that failed."""
    plugin_names = {r.plugin for r in xcp.backend_table()}
    assert {"cpu", "cuda", "npu"} <= plugin_names
    monkeypatch.setenv(settings.DISABLE_PLUGIN_AUTOLOAD.name, "1")
    plugins.reload_plugins()
    assert {r.plugin for r in xcp.backend_table()} == {"cpu"}


# ------------------------------------------------------------------------------- selection


@pytest.fixture
def alpha():
    """A registered CPU-kernel backend 'alpha' that counts its forward calls, and 'beta' of device type
    'fakedev'."""

    class Alpha(CPUBackend):
        name = "alpha"
        calls = 0

        def forward(self, q, k, v, mask, scale):
            type(self).calls += 1
            return super().forward(q, k, v, mask, scale)

    beta = backend_class("beta", device_type="fakedev")()
    plugin = plugin_for(Alpha(), beta)
    xcp.register_plugin(plugin, name="alpha-plugin")
    yield Alpha
    xcp.unregister_plugin(plugin)


def test_selection_precedence(alpha, monkeypatch):
    assert plugins.select_backend("alpha", "cpu").name == "alpha"  # explicit first
    assert plugins.select_backend("alpha:0", None).name == "alpha"  # device index ignored
    assert plugins.select_backend(None, "cpu").name == "cpu"  # then the tensors' device type
    assert plugins.select_backend(None, None).name == "cpu"  # default
    monkeypatch.setenv(settings.DEVICE.name, "alpha")
    assert plugins.select_backend(None, None).name == "alpha"  # XCP_DEVICE when nothing else says
    assert plugins.select_backend(None, "cpu").name == "cpu"  # the tensors win over XCP_DEVICE
    assert plugins.select_backend("cpu", None).name == "cpu"  # an explicit device wins over XCP_DEVICE
    assert plugins.select_backend(None, "fakedev").name == "beta"  # a device type served by one backend


def test_selection_error_says_where_the_name_came_from(alpha, monkeypatch):
    with pytest.raises(RuntimeError, match=r"^device='nope': backend 'nope' is unknown"):
        plugins.select_backend("nope", "cpu")
    monkeypatch.setenv(settings.DEVICE.name, "nope")
    with pytest.raises(RuntimeError, match=r"^XCP_DEVICE='nope': backend 'nope' is unknown"):
        plugins.select_backend(None, None)


def test_attention_runs_on_the_explicitly_chosen_backend(alpha):
    q, k, v = (torch.randn(1, 6, 2, 4, dtype=torch.float64) for _ in range(3))
    expected = xcp.attention(q, k, v, device="cpu")
    calls = alpha.calls
    got = xcp.attention(q, k, v, device="alpha")
    assert alpha.calls == calls + 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # same math kernel, same bits


def test_unavailable_backend_error_lists_every_backend_and_why():
    plugin = plugin_for(backend_class("foo", why_not="needs libfoo")())
    xcp.register_plugin(plugin, name="foo")
    try:
        with pytest.raises(RuntimeError) as err:
            xcp.get_backend("foo")
        lines = str(err.value).splitlines()
        assert lines[0] == "backend 'foo' is not usable here: needs libfoo"
        assert lines[1] == "installed backends:"
        assert "  cpu: available" in lines and "  foo: needs libfoo" in lines
        row = next(r for r in xcp.backend_table() if r.name == "foo")
        assert (row.available, row.reason) == (False, "needs libfoo")
        q = torch.randn(1, 4, 1, 4)
        with pytest.raises(RuntimeError, match=r"^device='foo': backend 'foo' is not usable here: needs libfoo"):
            xcp.attention(q, q, q, device="foo")
    finally:
        xcp.unregister_plugin(plugin)


def test_get_backend_rejects_a_non_string_name():
    with pytest.raises(TypeError, match="name: expected a backend name"):
        xcp.get_backend(3)


@pytest.mark.parametrize("module, cls", [("xcp_cuda", "CUDABackend"), ("xcp_npu", "NPUBackend")])
def test_vendor_plugin_registers_through_the_hook(module, cls):
    """xcp_cuda and xcp_npu register exactly like a third-party plugin: one hook call, one backend."""
    import importlib

    pm = pluggy.PluginManager("xcp")
    pm.add_hookspecs(xcp.hookspecs)
    pm.register(importlib.import_module(f"{module}.plugin"))
    got = []
    pm.hook.xcp_register_backends(register=got.append)
    assert len(got) == 1 and isinstance(got[0], getattr(importlib.import_module(module), cls))


def test_the_contract_is_three_groups_and_docs_backends_md_documents_each_member_in_its_group():
    """Every public member of xcp.Backend is in exactly one of the groups (required device primitives,
    optional fast paths, tool hooks), and docs/backends.md lists it in that group's section."""
    from pathlib import Path

    from xcp.backends import base

    groups = {
        "Required device primitives": base.REQUIRED_PRIMITIVES,
        "Optional fast paths": base.FAST_PATHS,
        "Tool hooks": base.TOOL_HOOKS,
    }
    listed = [name for members in groups.values() for name in members]
    assert len(listed) == len(set(listed)), "a member listed in two groups"
    assert set(listed) == {n for n in dir(base.Backend) if not n.startswith("_")}
    doc = (Path(__file__).resolve().parents[1] / "docs" / "backends.md").read_text()
    titles = list(groups)
    for i, title in enumerate(titles):
        start = doc.index(f"### {title}\n")
        end = doc.index(f"### {titles[i + 1]}\n") if i + 1 < len(titles) else doc.index("\n## ", start)
        section = doc[start:end]
        missing = [name for name in groups[title] if f"`{name}" not in section]
        assert not missing, f"docs/backends.md, {title}: {missing}"


def test_docs_backends_md_lists_what_synchronous_backend_changes():
    """The table of SynchronousBackend's defaults names exactly the members it overrides, and its hand-off."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "backends.md").read_text()
    start = doc.index("| member | on `SynchronousBackend` |")
    table = doc[start : doc.index("\n\n", start)]
    named = set(re.findall(r"`(\w+)`", table)) - {"SynchronousBackend", "None", "False", "none"}
    overridden = {n for n in vars(xcp.SynchronousBackend) if not n.startswith("_")}
    assert named == overridden
    assert xcp.SynchronousBackend.handoff_policy == "none" and '| `handoff_policy` | `"none"`' in table
