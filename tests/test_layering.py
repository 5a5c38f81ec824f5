"""Imports in xcp/ point down: no circle, and no module imports one of a higher layer.

The graph is built with ast from every module's source: ``import`` and ``from ... import`` (absolute and
relative), at module level and inside functions alike (a function-level import is a dependency that runs
later, not an exemption). ``from X import name`` counts as an import of ``X.name`` where that is a module,
else of ``X``. Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "xcp"

LAYERS: dict[str, int] = {
    # 0: pure tables and plans, the math kernels
    "xcp.settings": 0,
    "xcp.schedule": 0,
    "xcp.kernels": 0,
    # 1: plans over documents and a KV cache's tokens, buffer lifetimes, traffic counts, the call spec
    "xcp.documents": 1,
    "xcp.lifetime": 1,
    "xcp.traffic": 1,
    "xcp.spec": 1,
    "xcp.inference": 1,  # the package's __init__: imports nothing
    "xcp.inference.plan": 1,
    "xcp.inference.state": 1,
    "xcp.inference.serving": 1,
    "xcp.serving": 1,
    # 2: every argument check of a call; padding a sequence to a length the balance splits
    "xcp.checks": 2,
    "xcp.padding": 2,
    # 3: communicators and backends
    "xcp.comm": 3,
    "xcp.backends": 3,
    "xcp.hookspecs": 3,
    "xcp.plugins": 3,
    # 4: the ring and the agreement its ranks reach first
    "xcp.agreement": 4,
    "xcp.ring": 4,
    # 5: partial attentions and their combine; the KV caches (their block calls and lifetimes are the ring's)
    "xcp.inference.partials": 5,
    "xcp.inference.cache": 5,
    "xcp.inference.paged": 5,
    "xcp.inference.paged_decode": 5,
    # 5: the hybrid all-to-all around the ring
    "xcp.hybrid": 5,
    # 5: state passing and halos of recurrent layers (their exchanges are the communicators')
    "xcp.recurrent": 5,
    # 6: the compiled custom op
    "xcp.ops": 6,
    # 7: the entry points and the public face
    "xcp.api": 7,
    "xcp.context": 7,
    "xcp": 7,
    # 8: integrations with other libraries
    "xcp.integrations": 8,
    # 9: the tools
    "xcp.cli": 9,
    "xcp.testing": 9,
    "xcp.__main__": 9,
}
"""Module (or package: every module under it) -> layer; the longest name that matches wins, and ``xcp``
names the package's own ``__init__`` only. A module may import one of its own layer or a lower one."""


def layer_of(module: str, layers: Mapping[str, int] = LAYERS) -> int | None:
    """The layer of ``module``: that of the longest entry of ``layers`` naming it or a package above it."""
    best = None
    for name in layers:
        exact_only = "." not in name
        if module == name or (not exact_only and module.startswith(name + ".")):
            if best is None or len(name) > len(best):
                best = name
    return None if best is None else layers[best]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    return skipped


def imports_of(module: str, source: str, is_package: bool, modules: Iterable[str]) -> set[str]:
    """The modules of ``modules`` that ``source`` (the text of ``module``) imports anywhere in it."""
    known = set(modules)
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    skipped = _type_checking_blocks(tree)
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the xcp modules it imports, for every module under ``package``."""
    paths = {module_name(p, package.parent): p for p in package.rglob("*.py")}
    return {m: imports_of(m, p.read_text(), p.name == "__init__.py", paths) for m, p in sorted(paths.items())}


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (each holds a circle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def problems(graph: Mapping[str, Iterable[str]], layers: Mapping[str, int] = LAYERS) -> list[str]:
    """Every circle, every import of a higher layer, and every module without a layer, as sentences."""
    out = [f"import circle: {' <-> '.join(group)}" for group in circles(graph)]
    for module in sorted(graph):
        mine = layer_of(module, layers)
        if mine is None:
            out.append(f"{module}: no layer declared (add it to LAYERS in tests/test_layering.py)")
            continue
        for dep in sorted(graph[module]):
            theirs = layer_of(dep, layers)
            if theirs is not None and theirs > mine:
                out.append(f"{module} (layer {mine}) imports {dep} (layer {theirs}): an import upward")
    return out


def test_xcp_imports_point_down_and_hold_no_circle():
    graph = import_graph()
    assert {"xcp.api", "xcp.checks", "xcp.ring", "xcp.hybrid", "xcp.ops", "xcp.schedule"} <= set(graph)
    assert "xcp.checks" in graph["xcp.api"] and "xcp.api" not in graph["xcp.hybrid"] | graph["xcp.ops"]
    found = problems(graph)
    assert found == [], "\n".join(found)


def test_the_checker_reports_a_circle_and_an_upward_import():
    circle = {"xcp.ring": {"xcp.agreement"}, "xcp.agreement": {"xcp.ring"}, "xcp.schedule": set()}
    assert circles(circle) == [["xcp.agreement", "xcp.ring"]]
    assert problems(circle) == ["import circle: xcp.agreement <-> xcp.ring"]
    upward = {"xcp.schedule": {"xcp.api"}, "xcp.api": {"xcp.schedule"}}
    found = problems(upward)
    assert "xcp.schedule (layer 0) imports xcp.api (layer 7): an import upward" in found
    assert any(p.startswith("import circle: xcp.api <-> xcp.schedule") for p in found)
    longer = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(longer) == [["a", "b", "c"]]
    assert problems({"xcp.unknown": set()}, LAYERS) == [
        "xcp.unknown: no layer declared (add it to LAYERS in tests/test_layering.py)"
    ]


def test_the_graph_sees_function_level_and_relative_imports():
    modules = {"xcp", "xcp.api", "xcp.checks", "xcp.hybrid", "xcp.comm", "xcp.comm.local", "xcp.kernels.merge"}
    source = (
        "from . import checks\n"
        "from .comm import local\n"
        "from ..kernels.merge import NEG_INF\n"
        "import xcp.api\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .comm import Communicator\n"
        "def f():\n"
        "    from .api import attention\n"
    )
    got = imports_of("xcp.hybrid", source.replace("..kernels", ".kernels"), False, modules)
    assert got == {"xcp.checks", "xcp.comm.local", "xcp.kernels.merge", "xcp.api"}
    assert imports_of("xcp.comm.local", "from ..kernels.merge import NEG_INF\n", False, modules) == {
        "xcp.kernels.merge"
    }
    assert layer_of("xcp.comm.local") == layer_of("xcp.comm") == 3
    assert layer_of("xcp.backends.fused") == 3 and layer_of("xcp.kernels.math") == 0
    assert layer_of("xcp") == 7 and layer_of("xcp.nothing") is None
