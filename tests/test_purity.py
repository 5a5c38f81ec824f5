"""The core under xcp/ stays device-agnostic: no vendor module, no torch.cuda (xcp/testing/ excepted).

Imports are found with ast (``import``, ``from ... import``, and ``importlib.import_module`` /
``__import__`` with a literal name); ``torch.cuda`` is found by a plain text scan, so it is caught in
attribute chains, strings and comments alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "xcp"
VENDOR_MODULES = ("torch_npu", "flash_attn")
FORBIDDEN_TEXT = "torch.cuda"


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
        if FORBIDDEN_TEXT in line:
            problems.append(f"{filename}:{lineno}: says {FORBIDDEN_TEXT}")
    return problems


def core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "testing" not in p.relative_to(CORE).parts[:-1])


def test_core_files_are_found():
    names = {p.relative_to(CORE).as_posix() for p in core_files()}
    assert {"api.py", "backend.py", "plugins.py", "ring.py"} <= names
    assert not any(n.startswith("testing/") for n in names)


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
    ],
)
def test_checker_catches_each_kind_of_violation(source):
    assert violations(source)


def test_checker_accepts_generic_code():
    source = "import torch\nm = torch.get_device_module('npu')\nfrom .backend import Backend\n# npu, flash\n"
    assert violations(source) == []
