"""xcp.settings: the one parser of every XCP_* variable, the declared table (core and backends),
``xcp backends --settings``, that nothing else reads an XCP_* variable from the environment, and that the
docs list exactly the declared variables."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from xcp import settings
from xcp.cli import main
from xcp.settings import READ_AT_CONSTRUCTION, READ_PER_CALL, Setting, declared
from xcp_cuda import CUDABackend
from xcp_npu import NPUBackend

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("xcp", "xcp_cuda", "xcp_npu")
REPOSITORY_BACKENDS = (CUDABackend, NPUBackend)
"""The backends this repository ships (classes: their ``settings`` is a class attribute)."""


def _setting(kind: str, **kwargs) -> Setting:
    return Setting("XCP_TEST_VALUE", kind, kwargs.pop("default", None), "a test", READ_PER_CALL, **kwargs)


# ---------------------------------------------------------------------------------------------- the parser
@pytest.mark.parametrize(
    ("kind", "choices", "text", "value"),
    [
        ("flag", (), "1", True),
        ("flag", (), "0", False),
        ("flag", (), " 1 ", True),  # stripped
        ("seconds", (), "2.5", 2.5),
        ("seconds", (), "600", 600.0),
        ("choice", ("native", "repeat"), "repeat", "repeat"),
        ("name", (), "cuda", "cuda"),
    ],
)
def test_each_kind_parses_its_values(monkeypatch, kind, choices, text, value):
    monkeypatch.setenv("XCP_TEST_VALUE", text)
    got = _setting(kind, choices=choices).read()
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    ("kind", "choices", "text", "message"),
    [
        ("flag", (), "yes", "XCP_TEST_VALUE: expected 0 or 1; got 'yes'"),
        ("flag", (), "2", "XCP_TEST_VALUE: expected 0 or 1; got '2'"),
        ("seconds", (), "soon", "XCP_TEST_VALUE: expected a positive number of seconds; got 'soon'"),
        ("seconds", (), "0", "XCP_TEST_VALUE: expected a positive number of seconds; got '0'"),
        ("seconds", (), "-3", "XCP_TEST_VALUE: expected a positive number of seconds; got '-3'"),
        ("seconds", (), "inf", "XCP_TEST_VALUE: expected a positive number of seconds; got 'inf'"),
        ("seconds", (), "nan", "XCP_TEST_VALUE: expected a positive number of seconds; got 'nan'"),
        ("choice", ("native", "repeat"), "often", "XCP_TEST_VALUE: expected one of native, repeat; got 'often'"),
    ],
)
def test_a_bad_value_names_the_variable_what_it_takes_and_what_it_got(monkeypatch, kind, choices, text, message):
    monkeypatch.setenv("XCP_TEST_VALUE", text)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _setting(kind, choices=choices).read()


@pytest.mark.parametrize("text", [None, "", "   "])
def test_unset_or_empty_gives_the_default_or_the_callers(monkeypatch, text):
    if text is None:
        monkeypatch.delenv("XCP_TEST_VALUE", raising=False)
    else:
        monkeypatch.setenv("XCP_TEST_VALUE", text)
    assert _setting("flag", default=True).read() is True
    assert _setting("flag", default=True).read(False) is False
    assert _setting("seconds").read() is None


def test_the_value_is_read_at_each_read_never_cached(monkeypatch):
    s = _setting("seconds")
    monkeypatch.setenv("XCP_TEST_VALUE", "1")
    assert s.read() == 1.0
    monkeypatch.setenv("XCP_TEST_VALUE", "2")
    assert s.read() == 2.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("TEST", "flag", None), "Setting.name: expected a name starting with XCP_; got 'TEST'"),
        (("XCP_TEST", "number", None), "Setting.kind: expected one of flag, seconds, choice, name; got 'number'"),
        (("XCP_TEST", "choice", None), "Setting.choices: expected choices exactly for kind 'choice'; got ()"),
    ],
)
def test_a_malformed_declaration_is_refused(args, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Setting(*args, "meaning", READ_PER_CALL)
    with pytest.raises(ValueError, match="Setting.choices: expected choices exactly for kind 'choice'"):
        Setting("XCP_TEST", "flag", None, "meaning", READ_PER_CALL, ("a",))


# ---------------------------------------------------------------------------------------------- declared
class _Owner:
    def __init__(self, name: str, *declared_settings: Setting) -> None:
        self.name, self.settings = name, declared_settings


def test_declared_lists_the_core_then_each_backends_settings_once():
    a = Setting("XCP_TEST_A", "flag", False, "a", READ_AT_CONSTRUCTION)
    b = Setting("XCP_TEST_B", "name", None, "b", READ_AT_CONSTRUCTION)
    got = declared([_Owner("one", a, b), _Owner("two", a), object()])  # the same declaration twice: once
    assert got == (*settings.CORE, a, b)
    assert declared() == settings.CORE
    assert [s.name for s in settings.CORE] == ["XCP_TIMEOUT", "XCP_DEVICE", "XCP_DISABLE_PLUGIN_AUTOLOAD"]


def test_a_name_declared_twice_differently_names_both_owners():
    a = Setting("XCP_TEST_A", "flag", False, "a", READ_AT_CONSTRUCTION)
    other = Setting("XCP_TEST_A", "flag", True, "a", READ_AT_CONSTRUCTION)
    with pytest.raises(ValueError, match="^XCP_TEST_A: declared by 'one' and differently by 'two'$"):
        declared([_Owner("one", a), _Owner("two", other)])
    core_clash = Setting("XCP_DEVICE", "name", "cpu", "mine", READ_AT_CONSTRUCTION)
    with pytest.raises(ValueError, match="^XCP_DEVICE: declared by 'xcp' and differently by 'mine'$"):
        declared([_Owner("mine", core_clash)])


def test_the_repositorys_backends_declare_their_settings_under_their_prefix():
    for cls, prefix in ((CUDABackend, "XCP_CUDA_"), (NPUBackend, "XCP_NPU_")):
        assert cls.settings and all(s.name.startswith(prefix) for s in cls.settings), cls
        assert cls.gqa_setting in cls.settings
        assert all(s.read_when == READ_AT_CONSTRUCTION for s in cls.settings)
    assert len(declared(REPOSITORY_BACKENDS)) == len(settings.CORE) + 11


# ---------------------------------------------------------------------------------------------- the CLI table
def test_xcp_backends_settings_prints_every_declared_setting_with_its_current_value(capsys, monkeypatch):
    from xcp.plugins import list_backends

    monkeypatch.setenv("XCP_TIMEOUT", "30")
    monkeypatch.setenv("XCP_DEVICE", "nowhere:1")
    assert main(["backends", "--settings"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the meanings are wrapped
    for s in declared(list_backends()):
        row = settings.describe(s)
        assert f"{s.name}  ({row['kind']}; default {row['default']}; now {row['current']})" in out
        assert " ".join(s.meaning.split()) in flat and f"read {s.read_when}" in flat
    assert "XCP_TIMEOUT  (seconds; default unset; now '30' -> 30.0)" in out
    assert "XCP_DEVICE  (name; default unset; now 'nowhere:1' -> 'nowhere:1')" in out
    monkeypatch.setenv("XCP_TIMEOUT", "later")
    assert main(["backends", "--settings"]) == 0
    assert (
        "XCP_TIMEOUT  (seconds; default unset; now invalid: XCP_TIMEOUT: expected a positive number of seconds; "
        "got 'later')" in capsys.readouterr().out
    )


def test_xcp_backends_settings_names_a_plugin_whose_settings_failed(capsys, monkeypatch):
    from xcp import plugins

    monkeypatch.setenv("XCP_CUDA_GQA", "sometimes")
    plugins.reload_plugins()
    try:
        with pytest.warns(plugins.PluginWarning, match="XCP_CUDA_GQA: expected one of native, repeat"):
            assert main(["backends", "--settings"]) == 0
    finally:
        monkeypatch.delenv("XCP_CUDA_GQA")
        plugins.reload_plugins()
    out = capsys.readouterr().out
    assert (
        "plugin 'cuda' failed to register: ValueError: XCP_CUDA_GQA: expected one of native, repeat; got "
        "'sometimes' (its settings are not listed)" in out
    )
    assert "XCP_CUDA_CUDNN" not in out and "XCP_NPU_GQA" in out


# ---------------------------------------------------------------------------------------------- one reader
ENV_READERS = ("environ", "getenv", "environb", "getenvb")


def environment_reads(source: str, filename: str = "<source>") -> list[str]:
    """Every read of an ``XCP_*`` variable from the environment in ``source``, as ``file:line: what``.

    A read is ``os.environ[...]``, ``os.environ.get(...)``, ``os.getenv(...)``, ``... in os.environ`` and
    the like; its key counts as an ``XCP_*`` name when it is such a literal, an f-string that starts with
    one, or a module-level constant holding one. A key the scan cannot resolve counts too where the file
    names an ``XCP_*`` variable anywhere in its code (not its docstrings).
    """
    tree = ast.parse(source, filename)
    xcp_name = re.compile(r"^XCP_[A-Z0-9_]*$")
    constants = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str) and xcp_name.match(node.value.value)
        for target in node.targets if isinstance(target, ast.Name)
    }  # fmt: skip
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
        and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    names_one = any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and "XCP_" in n.value and id(n) not in docstrings
        for n in ast.walk(tree)
    )

    def reads_environment(node: ast.AST) -> bool:
        return any(isinstance(n, (ast.Attribute, ast.Name)) and (getattr(n, "attr", None) or getattr(n, "id", None))
                   in ENV_READERS for n in ast.walk(node))  # fmt: skip

    def verdict(key: ast.AST | None) -> str | None:
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value if xcp_name.match(key.value) else None
        if isinstance(key, ast.Name) and key.id in constants:
            return key.id
        if isinstance(key, ast.JoinedStr) and key.values:
            first = key.values[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("XCP_"):
                return "an f-string XCP_ name"
        if key is not None and not isinstance(key, ast.Constant) and names_one:
            return f"a key it cannot resolve ({ast.unparse(key)})"
        return None

    problems = []
    for node in ast.walk(tree):
        key: ast.AST | None = None
        if isinstance(node, ast.Call) and reads_environment(node.func):
            key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and reads_environment(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(reads_environment(c) for c in node.comparators):
            key = node.left
        else:
            continue
        what = verdict(key)
        if what is not None:
            problems.append(f"{filename}:{node.lineno}: reads {what} from the environment")
    return problems


def test_the_scan_finds_each_way_of_reading_an_xcp_variable():
    source = (
        "import os\nfrom os import environ, getenv\nNAME = 'XCP_A'\n"
        "a = os.environ.get('XCP_B', '')\nb = os.environ[NAME]\nc = getenv(f'XCP_{a}')\n"
        "d = 'XCP_C' in environ\ne = os.environ.get(self.env_name)\nf = os.environ.get('RANK')\n"
    )
    assert environment_reads(source, "m.py") == [
        "m.py:4: reads XCP_B from the environment",
        "m.py:5: reads NAME from the environment",
        "m.py:6: reads an f-string XCP_ name from the environment",
        "m.py:7: reads XCP_C from the environment",
        "m.py:8: reads a key it cannot resolve (self.env_name) from the environment",
    ]
    assert environment_reads('"""Reads XCP_A through xcp.settings."""\nimport os\nx = os.environ.get(k)\n') == []


def test_no_module_but_xcp_settings_reads_an_xcp_variable_from_the_environment():
    problems = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative != "xcp/settings.py":
                problems += environment_reads(path.read_text(), relative)
    assert not problems, "read XCP_* variables through xcp.settings (Setting.read()):\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------- the docs
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MENTION = re.compile(r"XCP_[A-Z0-9_]*[A-Z0-9](\*)?|XCP_[A-Z0-9_]*_\*")


def _mentions(text: str) -> set[str]:
    return {m.group(0) for m in MENTION.finditer(text)}


def test_the_docs_name_only_declared_variables_and_the_settings_table_lists_every_one():
    names = {s.name for s in declared(REPOSITORY_BACKENDS)}
    unknown = []
    for path in DOCS:
        for mention in sorted(_mentions(path.read_text())):
            prefix = mention.rstrip("*")
            known = any(n.startswith(prefix) for n in names) if mention.endswith("*") else mention in names
            if not known:
                unknown.append(f"{path.relative_to(ROOT)}: {mention}")
    assert not unknown, "undeclared XCP_* variables in the docs:\n" + "\n".join(unknown)
    table = {
        m.group(1)
        for m in re.finditer(r"^\| `(XCP_[A-Z0-9_]+)` \|", (ROOT / "docs" / "backends.md").read_text(), re.MULTILINE)
    }
    assert table == names, f"docs/backends.md's settings table: missing {names - table}, extra {table - names}"
