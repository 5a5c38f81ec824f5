"""Packaging: the installed metadata (license, classifiers), the py.typed marker, and what installing xcp
costs other code: the pytest plugin it registers (entry point ``pytest11``) must load without torch, and
``python -m xcp.testing`` without pytest must say how to install it."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


# --------------------------------------------------------------------------------------------------------
# Metadata


def test_license_is_an_spdx_expression_with_its_file():
    meta = importlib.metadata.metadata("xcp")
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get("License") is None  # the legacy free-text field is not used alongside the expression
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_classifiers_include_python_versions_and_typed():
    classifiers = set(importlib.metadata.metadata("xcp").get_all("Classifier") or [])
    assert "Typing :: Typed" in classifiers
    assert "Operating System :: OS Independent" in classifiers
    assert "Topic :: Scientific/Engineering :: Artificial Intelligence" in classifiers
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers


def test_py_typed_is_in_the_package():
    assert importlib.resources.files("xcp").joinpath("py.typed").is_file()


def test_py_typed_is_declared_as_package_data():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["xcp"]


# --------------------------------------------------------------------------------------------------------
# The pytest plugin (loaded by every pytest run in an environment where xcp is installed)


def test_pytest_plugin_is_registered_through_pytest11():
    eps = [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.value == "xcp.testing.pytest_plugin"]
    assert eps and eps[0].dist.metadata["Name"] == "xcp"


def test_pytest_plugin_module_imports_nothing_heavy():
    # The module itself (the package xcp stubbed, so that only the plugin's own imports count).
    proc = run_python(
        f"""
        import sys, types
        stub = types.ModuleType("xcp"); stub.__path__ = [{str(ROOT / "xcp")!r}]; sys.modules["xcp"] = stub
        import xcp.testing.pytest_plugin
        heavy = sorted(n for n in sys.modules if n == "torch" or n.startswith(("torch.", "numpy", "xcp.")))
        print(heavy)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['xcp.testing', 'xcp.testing.pytest_plugin']", proc.stdout


def test_importing_the_pytest_plugin_loads_neither_torch_nor_xcp_api():
    proc = run_python("import xcp.testing.pytest_plugin, sys; print('torch' in sys.modules, 'xcp.api' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False False"


def test_pytest_plugin_does_nothing_without_its_option(tmp_path):
    # A pytest session that does not use --xcp-backend: the plugin loads, adds its option, touches no backend.
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xcp.testing.pytest_plugin", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--xcp-backend" in proc.stdout


# --------------------------------------------------------------------------------------------------------
# python -m xcp.testing without pytest

BLOCK_PYTEST = """
import runpy, sys

class BlockPytest:
    def find_spec(self, name, path=None, target=None):
        if name == "pytest" or name.startswith(("pytest.", "_pytest")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, BlockPytest())
for name in [n for n in sys.modules if n == "pytest" or n.startswith(("pytest.", "_pytest"))]:
    del sys.modules[name]
sys.argv = ["python -m xcp.testing", "--xcp-backend", "cpu"]
runpy.run_module("xcp.testing", run_name="__main__", alter_sys=True)
"""


def test_conformance_runner_without_pytest_says_how_to_install_it():
    proc = run_python(BLOCK_PYTEST)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "pytest" in lines[0]
    # Run from this checkout: the editable spelling of the extra.
    assert "pip install -e '.[test]'" in lines[0]


def test_install_hint_outside_a_checkout(tmp_path):
    import xcp.testing.__main__ as runner

    installed = tmp_path / "site-packages" / "xcp" / "testing" / "__main__.py"
    assert runner.install_hint(installed) == "pip install 'xcp[test]'"
