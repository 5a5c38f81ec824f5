"""The layering holds: the core under xcp/ stays device-agnostic (no vendor module, no device-specific
API such as ``torch.cuda``, ``CUDAGraph`` or a ``"cuda:0"`` device string; xcp/testing/ excepted), and
library modules never import the tools (``xcp.cli``) or ``xcp.testing``.

Imports are found with ast (``import``, ``from ... import`` absolute and relative, and
``importlib.import_module`` / ``__import__`` with a literal name); device-specific names are found by a
plain text scan, so they are caught in attribute chains, strings and comments alike.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "xcp"
VENDOR_MODULES = ("torch_npu", "flash_attn")
FORBIDDEN_TEXT = re.compile(r"torch\.(cuda|npu|xpu)\b|CUDAGraph|NPUGraph|[\"'](cuda|npu|xpu):\d")
"""Device-specific APIs and device strings with an index; a bare device type ("cuda") is a name, allowed."""

TOOLS = ("xcp.cli", "xcp.testing")
"""What the library (xcp/ outside these packages) must never import."""


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(source: str, filename: str = "<source>") -> list[str]:
    """Every vendor import and every ``torch.cuda`` in ``source``, as ``file:line: what``."""
    problems = []
    for lineno, module in _imported_modules(ast.parse(source, filename)):
        if module.split(".")[0] in VENDOR_MODULES:
            problems.append(f"{filename}:{lineno}: imports {module}")
    for lineno, line in enumerate(source.splitlines(), 1):
        found = FORBIDDEN_TEXT.search(line)
        if found:
            problems.append(f"{filename}:{lineno}: says {found.group(0)}")
    return problems


def _absolute(module: str | None, level: int, package: str) -> str:
    """The absolute name of an import made in ``package`` (``from ..testing import x`` -> ``xcp.testing``)."""
    if level == 0:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(base + ([module] if module else []))


def tool_imports(source: str, package: str, filename: str = "<source>") -> list[str]:
    """Every import of ``xcp.cli`` or ``xcp.testing`` in ``source``, a module of ``package``."""
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if any(name == t or name.startswith(t + ".") for t in TOOLS):
                problems.append(f"{filename}:{node.lineno}: imports {name}")
                break
    return problems


def core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "testing" not in p.relative_to(CORE).parts[:-1])


def library_files() -> list[Path]:
    """xcp/ without its tools (cli/ and the ``python -m xcp`` entry point) and xcp.testing."""
    return [p for p in core_files() if p.relative_to(CORE).parts[0] not in ("cli", "__main__.py")]


def _package(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts if path.name == "__init__.py" else parts[:-1]).removesuffix(".__init__")


def test_core_files_are_found():
    names = {p.relative_to(CORE).as_posix() for p in core_files()}
    assert {"api.py", "backends/base.py", "plugins.py", "ring.py", "kernels/math.py", "cli/bench/__init__.py"} <= names
    assert not any(n.startswith("testing/") for n in names)
    assert not any(p.relative_to(CORE).parts[0] == "cli" for p in library_files())


def test_library_never_imports_the_tools_or_testing():
    problems = [v for p in library_files() for v in tool_imports(p.read_text(), _package(p), str(p))]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "package"),
    [
        ("from xcp.cli import main\n", "xcp"),
        ("import xcp.testing.reference\n", "xcp"),
        ("from .testing.reference import sdpa_reference\n", "xcp"),
        ("from ..cli.common import DTYPES\n", "xcp.kernels"),
        ("from . import cli\n", "xcp"),
        ("def f():\n    from .testing import sanitizer\n", "xcp"),
    ],
)
def test_layering_checker_catches_each_kind_of_import(source, package):
    assert tool_imports(source, package)


def test_layering_checker_accepts_library_imports():
    source = "from . import schedule\nfrom ..kernels.merge import NEG_INF\nimport xcp.api\n"
    assert tool_imports(source, "xcp.kernels") == []


def test_core_is_device_agnostic():
    problems = [v for p in core_files() for v in violations(p.read_text(), str(p.relative_to(CORE.parent)))]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "import torch_npu\n",
        "import torch_npu.contrib as c\n",
        "from flash_attn import flash_attn_func\n",
        "from flash_attn.bert_padding import pad_input\n",
        "def f():\n    import flash_attn\n",
        "import importlib\nm = importlib.import_module('torch_npu')\n",
        "m = __import__('flash_attn')\n",
        "import torch\nx = torch.cuda.current_stream()\n",
        "s = 'torch.cuda'\n",
        "# uses torch.cuda.Event\n",
        "g = torch.cuda.CUDAGraph()\n",
        "from torch.cuda import CUDAGraph\n",
        "x = torch.zeros(1, device='cuda:0')\n",
        'd = torch.device("npu:1")\n',
        "s = torch.npu.current_stream()\n",
    ],
)
def test_checker_catches_each_kind_of_violation(source):
    assert violations(source)


def test_checker_accepts_generic_code():
    source = "import torch\nm = torch.get_device_module('npu')\nfrom .backend import Backend\n# npu, flash\n"
    source += "d = 'cuda'\n"
    assert violations(source) == []
