#!/usr/bin/env python3
"""Mutation testing of xcp's pure core: does the suite notice each small wrong change?

Each mutant is one small change to one module — a statement replaced by ``pass``, a comparison flipped or
moved across its boundary, an arithmetic operator swapped, ``and``/``or`` swapped, a ``not`` dropped, an
integer constant moved by one, ``True``/``False`` swapped — run against the tests that execute its line.
A mutant is *killed* when one of those tests fails, *survives* when all pass, *timed out* when they run past
the mutant's limit (a likely endless loop: counted as caught). Survivors judged equivalent (no behaviour can
tell them apart) or dead (the line cannot matter) are listed with their reason in
tools/mutate_equivalent.toml and set aside in the adjusted score.

Two steps (docs/testing.md has the numbers and how long each takes)::

    python tools/mutate.py map                       # once: run the suite, record which tests run each line
    python tools/mutate.py run xcp/lifetime.py       # per module: make, run and judge its mutants

``map`` runs the whole suite once with line tracing of the target modules, in this process's tests and in
the processes they start (gloo ranks, the CLI), and saves .mutate/map.json. ``run`` forks one process per
mutant from a server that has imported torch, pytest and hypothesis but not xcp; the child puts a mirror
of the repository whose module is mutated first on sys.path and PYTHONPATH (so the tests' subprocesses see
the mutant too) and runs the covering tests, fastest first, stopping at the first failure. Not part of CI.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import contextlib
import copy
import difflib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tools" / "mutate_trace"
STATE = ROOT / ".mutate"
MAP = STATE / "map.json"
EQUIVALENT = ROOT / "tools" / "mutate_equivalent.toml"

MODULES = (
    "xcp/schedule.py",
    "xcp/lifetime.py",
    "xcp/inference/plan.py",
    "xcp/documents.py",
    "xcp/kernels/merge.py",
    "xcp/inference/state.py",
    "xcp/traffic.py",
    "xcp/agreement.py",
    "xcp/recurrent/state.py",
    "xcp/recurrent/conv.py",
    "xcp/recurrent/layout.py",
    "xcp/recurrent/exchange.py",
    "xcp/inference/paged.py",
    "xcp/inference/partials.py",
)
"""The pure core the issue's target names, with the hybrid (state passing, halos) and serving (block
tables, the combine) modules added since; ``map`` traces these unless told others."""

# ------------------------------------------------------------------------------------------------ mutants

_COMPARE = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BINARY = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_SYMBOL = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.FloorDiv: "//",
    ast.Div: "/",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.And: "and",
    ast.Or: "or",
}
_REMOVABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Raise, ast.Assert, ast.Delete)


@dataclass
class Mutant:
    """One change: replace the source from (line, col) to (end_line, end_col) by ``text``."""

    module: str
    line: int
    col: int
    end_line: int
    end_col: int
    text: str
    what: str
    source_line: str = ""
    occurrence: int = 1
    test_line: int = 0
    """The line whose tests run the mutant: its own, or for a default argument the function's first
    statement (the signature's lines run at import)."""
    at_import: tuple[str, ...] | None = None
    """For a change outside every function body (it runs when the module is imported): the names the
    statement binds; None inside a function."""

    @property
    def key(self) -> str:
        """Names the mutant independently of line numbers: the line's text and the change."""
        return f"{self.what} #{self.occurrence}" if self.occurrence > 1 else self.what

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        start = sum(len(x) for x in lines[: self.line - 1]) + _byte_to_char(lines[self.line - 1], self.col)
        end = sum(len(x) for x in lines[: self.end_line - 1]) + _byte_to_char(lines[self.end_line - 1], self.end_col)
        return source[:start] + self.text + source[end:]


def _byte_to_char(line: str, col: int) -> int:
    return len(line.encode()[:col].decode())


def _skipped(tree: ast.AST) -> set[int]:
    """Nodes never mutated: annotations, decorators, f-strings, ``if TYPE_CHECKING`` blocks, ``__all__``,
    string statements (docstrings) and bare annotations."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for decorator in node.decorator_list:
                mark(decorator)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mark(node.returns)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            mark(node)
        if isinstance(node, ast.JoinedStr):
            mark(node)  # positions inside f-strings are unreliable before Python 3.12
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            mark(node)
        if isinstance(node, ast.AnnAssign) and node.value is None:
            mark(node)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            mark(node)
    return skip


def _replacement(node: ast.expr, new: ast.expr) -> str:
    """``new`` as source for the span of ``node``, in parentheses, padded to keep the line count."""
    lines = (node.end_lineno or node.lineno) - node.lineno
    return "(" + ast.unparse(new) + "\n" * lines + ")"


def mutants(module: str) -> list[Mutant]:
    """Every mutant of ``module`` (a path relative to the repository), in source order."""
    source = (ROOT / module).read_text()
    tree = ast.parse(source)
    skip = _skipped(tree)
    found: list[Mutant] = []
    inside: set[int] = set()
    body_line: dict[int, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inside.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                for n in ast.walk(default) if default is not None and body else ():
                    body_line[id(n)] = body[0].lineno
    binds: dict[int, tuple[str, ...]] = {}
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.stmt) and id(stmt) not in inside:
            names = tuple(n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
            for n in ast.walk(stmt):
                binds.setdefault(id(n), names)

    def add(node: ast.AST, text: str, what: str) -> None:
        m = Mutant(module, node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, text, what)  # type: ignore[attr-defined]
        m.test_line = body_line.get(id(node), m.line)
        if id(node) not in inside:
            m.at_import = binds.get(id(node), ())
        found.append(m)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, _REMOVABLE):
            if not (isinstance(node, ast.Return) and node.value is None):
                add(node, "pass" + "\n" * ((node.end_lineno or node.lineno) - node.lineno), "statement removed")
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _COMPARE:
                    new = copy.deepcopy(node)
                    new.ops[i] = _COMPARE[type(op)]()
                    add(node, _replacement(node, new), f"`{_SYMBOL[type(op)]}` -> `{_SYMBOL[_COMPARE[type(op)]]}`")
        elif isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _BINARY:
            swapped = _BINARY[type(node.op)]
            what = f"`{_SYMBOL[type(node.op)]}` -> `{_SYMBOL[swapped]}`"
            if isinstance(node, ast.BinOp):
                new_bin = copy.deepcopy(node)
                new_bin.op = swapped()
                add(node, _replacement(node, new_bin), what)
            else:
                new_aug = copy.deepcopy(node)
                new_aug.op = swapped()
                add(node, ast.unparse(new_aug) + "\n" * ((node.end_lineno or node.lineno) - node.lineno), what)
        elif isinstance(node, ast.BoolOp):
            new_bool = copy.deepcopy(node)
            other = ast.Or if isinstance(node.op, ast.And) else ast.And
            new_bool.op = other()
            add(node, _replacement(node, new_bool), f"`{_SYMBOL[type(node.op)]}` -> `{_SYMBOL[other]}`")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(node, _replacement(node, node.operand), "`not` dropped")
        elif isinstance(node, ast.Constant) and not isinstance(node.value, str | bytes):
            value = node.value
            if isinstance(value, bool):
                add(node, str(not value), f"`{value}` -> `{not value}`")
            elif isinstance(value, int):
                add(node, f"({value + 1})", f"`{value}` -> `{value + 1}`")
    found.sort(key=lambda m: (m.line, m.col, m.what))
    source_lines = source.splitlines()
    seen: dict[tuple[str, str], int] = {}
    for m in found:
        m.source_line = source_lines[m.line - 1].strip()
        k = (m.source_line, m.what)
        seen[k] = m.occurrence = seen.get(k, 0) + 1
    return found


# ------------------------------------------------------------------------------------------------ line map


def build_map(modules: list[str], tests: list[str], merge: bool, named: bool = False) -> None:
    """Run ``tests`` once with line tracing of ``modules``; save which tests execute which lines. With
    ``merge``, add them to the saved map (for tests written since), which keeps its traced modules; with
    ``merge`` and modules ``named``, trace those alone and let this run's lines of them replace the map's
    (a module changed much since the map was made, or one it did not trace), the others kept as they are."""
    STATE.mkdir(exist_ok=True)
    old = load_map() if merge else None
    traced = [str((ROOT / m).resolve()) for m in modules]
    files = traced if not old or named else old["files"]
    out = STATE / "map-new.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TRACE), *filter(None, [env.get("PYTHONPATH")])])
    env["MUTATE_TRACE_FILES"] = os.pathsep.join(files)
    env["MUTATE_MAP_OUT"] = str(out)
    start = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "mutate_plugin", "-p", "no:cacheprovider", *tests]
    print("map:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    data = json.loads(out.read_text())
    if old:
        data = _merged(old, data, set(traced) if named else set())
    out.replace(MAP)
    MAP.write_text(json.dumps(data))
    print(f"map: {len(data['tests'])} tests ({time.time() - start:.0f} s) -> {MAP.relative_to(ROOT)}")


def _merged(old: dict, new: dict, replaced: set[str] | None = None) -> dict:
    """``new``'s tests added to ``old`` (replacing those of the same name), lines moved to ``old``'s text;
    for the files in ``replaced``, ``new``'s lines and text instead of ``old``'s."""
    replaced = replaced or set()
    names = list(old["tests"])
    keep = [i for i, n in enumerate(names) if n not in new["tests"]]
    index = {i: j for j, i in enumerate(keep)}
    tests = {names[i]: old["tests"][names[i]] for i in keep}
    base = len(tests)
    if replaced:  # the tests run again traced the replaced files alone: their lines of the others stay
        again = {n: base + j for j, n in enumerate(new["tests"])}
        index.update({i: again[n] for i, n in enumerate(names) if n in again})
    lines: dict[str, dict[str, list[int]]] = {}
    for file, by_line in old["lines"].items():
        if file in replaced:
            continue
        for line, idx in by_line.items():
            lines.setdefault(file, {})[line] = [index[i] for i in idx if i in index]
    tests.update(new["tests"])
    sources = {f: t for f, t in old.get("sources", {}).items() if f not in replaced}
    for file in replaced:
        sources[file] = new.get("sources", {}).get(file, "")
    for file, by_line in new["lines"].items():
        back = _line_translation(new.get("sources", {}).get(file), sources.get(file))
        for line, idx in by_line.items():
            for old_line in back(int(line)):
                lines.setdefault(file, {}).setdefault(str(old_line), []).extend(base + i for i in idx)
    files = [*old["files"], *sorted(replaced - set(old["files"]))]
    return {"files": files, "tests": tests, "lines": lines, "sources": sources}


def _line_translation(now: str | None, then: str | None) -> Callable[[int], list[int]]:
    """A function from a line of the text ``now`` to the lines of ``then`` it stands for: the same line
    where unchanged; for a changed or added line, the nearest unchanged lines above and below."""
    if now is None or then is None or now == then:
        return lambda line: [line]
    a, b = now.splitlines(), then.splitlines()
    same: dict[int, int] = {}
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            same[block.a + k + 1] = block.b + k + 1
    keys = sorted(same)

    def back(line: int) -> list[int]:
        if line in same:
            return [same[line]]
        i = bisect.bisect_left(keys, line)
        return [same[keys[j]] for j in (i - 1, i) if 0 <= j < len(keys)]

    return back


_translations: dict[str, Callable[[int], list[int]]] = {}


def load_map() -> dict:
    if not MAP.exists():
        sys.exit(f"{MAP.relative_to(ROOT)}: missing; run `python tools/mutate.py map` first")
    return json.loads(MAP.read_text())


def covering_tests(data: dict, module: str, line: int, budget: float) -> list[str]:
    """The passing tests that execute ``line`` of ``module`` (as it is now: lines changed since the map was
    made take the tests of their nearest unchanged neighbours), fastest first, within ``budget`` seconds."""
    names = list(data["tests"])
    file = str((ROOT / module).resolve())
    back = _translations.get(file)
    if back is None:
        back = _translations[file] = _line_translation((ROOT / module).read_text(), data.get("sources", {}).get(file))
    by_line = data["lines"].get(file, {})
    indices = {i for old in back(line) for i in by_line.get(str(old), [])}
    chosen = sorted(
        (data["tests"][names[i]][0], names[i]) for i in indices if data["tests"][names[i]][1] and _selectable(names[i])
    )
    picked: list[str] = []
    total = 0.0
    for seconds, name in chosen:
        if picked and total + seconds > budget:
            break
        picked.append(name)
        total += seconds
    return picked


def _tests_of_names(data: dict, module: str, names: tuple[str, ...], budget: float) -> list[str]:
    """For a change made at import time: the tests of the lines of ``module`` that use ``names`` (those the
    changed statement binds), within ``budget``; else the module's fastest tests."""
    lines = (ROOT / module).read_text().splitlines()
    uses = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b") if names else None
    chosen: dict[str, float] = {}
    for number, text in enumerate(lines, 1):
        if uses is not None and uses.search(text):
            for t in covering_tests(data, module, number, budget):
                chosen[t] = data["tests"][t][0]
    picked: list[str] = []
    total = 0.0
    for t in sorted(chosen, key=chosen.__getitem__):
        if picked and total + chosen[t] > budget:
            break
        picked.append(t)
        total += chosen[t]
    return picked or _fastest(data, module, 5)


def _collected(tests: set[str]) -> set[str]:
    """Those of ``tests`` (node ids) that pytest collects today."""
    files = sorted({t.split("::")[0] for t in tests})
    if not files:
        return set()
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False).stdout
    return {line.strip() for line in out.splitlines() if "::" in line} & tests


def _fastest(data: dict, module: str, n: int) -> list[str]:
    """The ``n`` fastest passing tests that execute any line of ``module``."""
    names = list(data["tests"])
    indices = {i for tests in data["lines"].get(str((ROOT / module).resolve()), {}).values() for i in tests}
    ranked = sorted((data["tests"][names[i]][0], names[i]) for i in indices if _selectable(names[i]))
    return [name for _, name in ranked][:n]


def _selectable(nodeid: str) -> bool:
    """Whether pytest can select ``nodeid`` from its command line: not a parameter id holding brackets
    (``test[cu-expected cu_seqlens[0] == 0]`` matches nothing there)."""
    params = nodeid.partition("[")[2]
    return not any(c in params[:-1] for c in "[]")


# ------------------------------------------------------------------------------------------------ running


def _mirror(module: str, text: str, into: Path) -> None:
    """A copy of the repository made of links, except ``module``, which holds ``text``."""
    parts = Path(module).parts
    here, src = into, ROOT
    for depth, part in enumerate(parts):
        here.mkdir(exist_ok=True)
        for entry in src.iterdir():
            if entry.name != part and entry.name not in (".git", ".venv", ".mutate"):
                (here / entry.name).symlink_to(entry)
        if depth == len(parts) - 1:
            (here / part).write_text(text)
        here, src = here / part, src / part


def _graft_function(old: Any, new: Any) -> bool:
    """Give the function ``old`` the code and defaults of ``new`` (every reference to ``old`` then runs the
    mutant); False where that cannot be done (different closures)."""
    while hasattr(old, "__wrapped__") and hasattr(new, "__wrapped__"):  # lru_cache, contextmanager, wraps
        if hasattr(old, "cache_clear"):
            old.cache_clear()
        old, new = old.__wrapped__, new.__wrapped__
    if not (isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType)):
        return False
    if old.__code__.co_freevars != new.__code__.co_freevars:
        return False
    old.__code__, old.__defaults__, old.__kwdefaults__ = new.__code__, new.__defaults__, new.__kwdefaults__
    return True


def _graft_class(old: type, new: type) -> None:
    """Make the class ``old`` behave as ``new`` (its methods grafted, its other attributes replaced)."""
    skip = {"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"}
    for name in set(vars(old)) - set(vars(new)) - skip:
        delattr(old, name)
    for name, value in vars(new).items():
        if name in skip:
            continue
        mine = vars(old).get(name)
        if isinstance(value, property) and isinstance(mine, property):
            pairs = [(mine.fget, value.fget), (mine.fset, value.fset), (mine.fdel, value.fdel)]
            if all(a is b is None or (a is not None and b is not None and _graft_function(a, b)) for a, b in pairs):
                continue
        elif isinstance(value, staticmethod | classmethod) and type(mine) is type(value):
            if _graft_function(mine.__func__, value.__func__):  # type: ignore[union-attr]
                continue
        elif mine is not None and _graft_function(mine, value):
            continue
        setattr(old, name, value)


def _graft_module(name: str, text: str) -> None:
    """Run the mutated source ``text`` of the imported module ``name`` in place; keep the identity of its
    functions and classes (other modules and tests hold them), giving them the mutant's code."""
    module = sys.modules[name]
    fresh = {k: v for k, v in vars(module).items() if k.startswith("__") and k.endswith("__")}
    exec(compile(text, module.__file__ or name, "exec"), fresh)
    moved: dict[str, tuple[Any, Any]] = {}  # name -> (old value, new value or _MISSING)
    for key in [k for k in vars(module) if k not in fresh]:  # names the mutant no longer defines
        moved[key] = (vars(module)[key], _MISSING)
        delattr(module, key)
    for key, new in fresh.items():
        old = vars(module).get(key, _MISSING)
        if key.startswith("__") and key.endswith("__"):
            continue
        if getattr(old, "__module__", None) == name and isinstance(old, type) and isinstance(new, type):
            _graft_class(old, new)
        elif not (getattr(old, "__module__", None) == name and _graft_function(old, new)):
            setattr(module, key, new)
            if old is not _MISSING and old is not new:
                moved[key] = (old, new)
    for other in list(sys.modules.values()):  # copies made by ``from module import NAME`` follow
        if other is module or not _ours(getattr(other, "__file__", None)):
            continue
        for key, (old, new) in moved.items():
            if vars(other).get(key, _MISSING) is old:
                if new is _MISSING:
                    delattr(other, key)
                else:
                    setattr(other, key, new)
    for other in list(sys.modules.values()):  # results cached with the unmutated code
        if getattr(other, "__name__", "").startswith("xcp"):
            for value in list(vars(other).values()):
                if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
                    value.cache_clear()


_MISSING = object()


def _child(mirror: Path, tests: list[str], module: str, text: str, cold: bool) -> None:
    """In the forked child: put the mutant in place (grafted into the imported module, and first on
    PYTHONPATH for the processes tests start) and run ``tests``; exit with pytest's status."""
    import pytest

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.dont_write_bytecode = True  # the mutant's bytecode must not land in the real __pycache__
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    name = _module_name(module)
    if name in sys.modules and not cold:
        _graft_module(name, text)
    else:  # import the repository's modules and tests afresh, from the mirror
        purged = [key for key, value in list(sys.modules.items()) if _ours(getattr(value, "__file__", None))]
        for key in purged:
            del sys.modules[key]
        sys.path.insert(0, str(mirror))
        import importlib

        try:  # the package's own modules first: a mutant that breaks importing them is caught by any test
            for key in sorted(k for k in purged if k.split(".")[0] in ("xcp", "xcp_cuda", "xcp_npu")):
                importlib.import_module(key)
        except Exception:
            os._exit(1)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(mirror), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = str(mirror / ".hypothesis-store")
    args = ["-x", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0", *tests]
    code = pytest.main(args)
    os._exit(int(code))


def _ours(path: str | None) -> bool:
    """Whether ``path`` is a file of the repository's packages or tests (not of this tool, nor of an
    environment installed inside the repository)."""
    if not path or not Path(path).is_relative_to(ROOT):
        return False
    return Path(path).relative_to(ROOT).parts[0] in ("xcp", "xcp_cuda", "xcp_npu", "examples", "tests")


def _module_name(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def warm_up(module: str, tests: list[str]) -> None:
    """Import ``module`` and the test files of ``tests`` (as pytest would) once, in the server: forked
    mutants then skip importing them, and get the mutant grafted in place (:func:`_graft_module`)."""
    import importlib

    sys.path.insert(0, str(ROOT / "tests"))
    importlib.import_module(_module_name(module))
    for file in sorted({t.split("::")[0] for t in tests}):
        path = Path(file)
        if path.parent == Path("tests"):
            importlib.import_module(path.stem)


def run_one(module: str, text: str, tests: list[str], timeout: float, cold: bool = False) -> str:
    """``killed``, ``survived`` or ``timeout`` for the mutated source ``text`` of ``module``; ``cold``: the
    repository's modules imported afresh (a change made at import time cannot be grafted)."""
    mirror = Path(tempfile.mkdtemp(prefix="mutant-"))
    try:
        _mirror(module, text, mirror)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            try:
                _child(mirror, tests, module, text, cold)
            finally:
                os._exit(70)
        deadline = time.time() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                # pytest: 0 all passed, 1 a test failed; anything else (usage error, a test not found,
                # nothing collected, an internal error) says nothing about the mutant
                return "survived" if code == 0 else "killed" if code == 1 else "error"
            if time.time() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "timeout"
            time.sleep(0.05)
    finally:
        shutil.rmtree(mirror, ignore_errors=True)


def equivalents() -> dict[tuple[str, str, str], str]:
    """(module, line text, change) -> reason, from tools/mutate_equivalent.toml."""
    if not EQUIVALENT.exists():
        return {}
    data = tomllib.loads(EQUIVALENT.read_text())
    return {(e["module"], e["line"], e["change"]): e["reason"] for e in data.get("mutant", [])}


@dataclass
class Tally:
    killed: int = 0
    survived: int = 0
    timeout: int = 0
    set_aside: int = 0
    uncovered: int = 0
    error: int = 0

    def row(self, module: str, seconds: float) -> str:
        total = self.killed + self.survived + self.timeout + self.uncovered + self.error
        caught = self.killed + self.timeout
        raw = 100 * caught / total if total else 100.0
        judged = total - self.set_aside
        adjusted = 100 * caught / judged if judged else 100.0
        return (
            f"| {module} | {total} | {self.killed} | {self.timeout} | {self.survived + self.uncovered} "
            f"| {self.set_aside} | {raw:.1f}% | {adjusted:.1f}% | {seconds / 60:.1f} min |"
            + (f" ({self.error} could not run: not caught)" if self.error else "")
        )


HEADER = (
    "| module | mutants | killed | timed out | survived | set aside | caught (raw) | caught (adjusted) | time |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def run_module(module: str, data: dict, args: argparse.Namespace, known: dict) -> tuple[Tally, float, list[str]]:
    import hypothesis  # noqa: F401  (imported once here, inherited by every forked mutant)
    import pytest  # noqa: F401
    import torch  # noqa: F401

    with contextlib.suppress(ImportError):
        import anyio  # noqa: F401  (a pytest plugin of the test extra; slow to import)

    start = time.time()
    tally, lines = Tally(), []
    found = mutants(module)
    if args.line:
        found = [m for m in found if m.line in args.line]
    if args.import_time:
        found = [m for m in found if m.at_import is not None]
    source = (ROOT / module).read_text()
    used = set()
    selected = []
    for m in found:
        if args.tests:
            selected.append((args.tests, args.budget))
        elif m.at_import is not None:
            tests = _tests_of_names(data, module, m.at_import, args.budget)
            selected.append((tests, sum(data["tests"][t][0] for t in tests)))
        else:
            tests = covering_tests(data, module, m.test_line, args.budget)
            selected.append((tests, sum(data["tests"][t][0] for t in tests)))
    if not args.tests:  # the map may name tests since renamed (--tests are pytest arguments: kept as given)
        present = _collected({t for tests, _ in selected for t in tests})
        selected = [([t for t in tests if t in present], seconds) for tests, seconds in selected]
    if not args.cold:
        warm_up(module, [t for tests, _ in selected for t in tests])
    if args.tests:
        check = args.tests
    else:  # the five fastest the map names that pytest still collects
        fastest = _fastest(data, module, 50)
        collected = _collected(set(fastest))
        check = [t for t in fastest if t in collected][:5]
    if check and run_one(module, source, check, 600) != "survived":
        sys.exit(f"{module}: the unmutated code fails {' '.join(check)} in the mutant harness; fix that first")
    print(f"{module}: {len(found)} mutants", flush=True)
    for i, (m, (tests, seconds)) in enumerate(zip(found, selected), 1):
        ident = (module, m.source_line, m.key)
        if not tests:
            verdict = "uncovered"
        else:
            limit = args.timeout_factor * seconds + args.timeout_extra
            verdict = run_one(module, m.apply(source), tests, limit, args.cold or m.at_import is not None)
            if verdict == "error" and run_one(module, source, tests, limit, True) == "survived":
                verdict = "killed"  # the tests run on the real code: the mutant broke them (an import, say)
        if verdict in ("survived", "uncovered"):
            if ident in known:
                used.add(ident)
                tally.set_aside += 1
                note = f"  set aside: {known[ident]}"
            else:
                note = ""
            lines.append(f"  {verdict.upper()} {module}:{m.line}: {m.key}    | {m.source_line}{note}")
            print(lines[-1], flush=True)
        elif verdict == "error":
            print(f"  ERROR (pytest could not run the tests) {module}:{m.line}: {m.key}    | {m.source_line}")
        elif verdict == "timeout":  # caught, but worth a look: an endless loop, or a limit too tight
            print(f"  TIMED OUT {module}:{m.line}: {m.key}    | {m.source_line}", flush=True)
        setattr(tally, verdict, getattr(tally, verdict) + 1)
        if args.verbose:
            print(f"  [{i}/{len(found)}] {verdict} {m.line}: {m.key} ({len(tests)} tests)", flush=True)
    stale = [k for k in known if k[0] == module and k not in used]
    if stale and not (args.line or args.import_time):
        for k in stale:
            print(f"  note: tools/mutate_equivalent.toml lists a mutant that no longer survives: {k}")
    return tally, time.time() - start, lines


def iter_modules(names: list[str]) -> Iterator[str]:
    for name in names or MODULES:
        path = (ROOT / name).resolve()
        if not path.is_file():
            sys.exit(f"module: expected a Python file under {ROOT}; got {name!r}")
        yield str(path.relative_to(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_map = sub.add_parser("map", help="run the suite once with line tracing; save .mutate/map.json")
    p_map.add_argument("modules", nargs="*", help=f"modules to trace (default: {' '.join(MODULES)})")
    p_map.add_argument("--tests", nargs="*", default=["tests"], help="pytest arguments selecting the tests")
    p_map.add_argument(
        "--merge",
        action="store_true",
        help="add these tests to the saved map (tests written since); modules named: re-traced, their lines replaced",
    )
    p_run = sub.add_parser("run", help="make and run the mutants of each module")
    p_run.add_argument("modules", nargs="*", help="modules (default: the pure core)")
    p_run.add_argument("--line", type=int, nargs="*", help="only the mutants of these lines")
    p_run.add_argument("--budget", type=float, default=60.0, help="seconds of covering tests per mutant (60)")
    p_run.add_argument("--timeout-factor", type=float, default=4.0, help="limit: factor x tests' seconds (4)")
    p_run.add_argument("--timeout-extra", type=float, default=30.0, help="limit: plus these seconds (30)")
    p_run.add_argument("--verbose", action="store_true", help="print every mutant's verdict")
    p_run.add_argument("--import-time", action="store_true", help="only the changes made when the module is imported")
    p_run.add_argument(
        "--cold", action="store_true", help="import xcp afresh in every mutant (slower; no grafting of the mutant)"
    )
    p_run.add_argument("--tests", nargs="+", help="run these pytest arguments for every mutant instead of the map's")
    p_list = sub.add_parser("list", help="print the mutants of each module")
    p_list.add_argument("modules", nargs="*")
    args = parser.parse_args(argv)

    if args.command == "map":
        build_map(list(iter_modules(args.modules)), args.tests, args.merge, bool(args.modules))
        return 0
    if args.command == "list":
        for module in iter_modules(args.modules):
            for m in mutants(module):
                print(f"{module}:{m.line}: {m.key}    | {m.source_line}")
        return 0
    data = {"files": [str((ROOT / m).resolve()) for m in MODULES + tuple(args.modules)]} if args.tests else load_map()
    known = equivalents()
    rows = []
    for module in iter_modules(args.modules):
        if str((ROOT / module).resolve()) not in data["files"]:
            sys.exit(f"{module}: not traced in {MAP.relative_to(ROOT)}; run `python tools/mutate.py map {module} ...`")
        tally, seconds, _ = run_module(module, data, args, known)
        rows.append(tally.row(module, seconds))
        print(HEADER + "\n" + rows[-1], flush=True)
    print("\n" + HEADER + "\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
