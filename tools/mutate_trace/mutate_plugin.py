"""pytest plugin of tools/mutate.py's line map: which lines of the traced files each test executes.

Loaded with ``-p mutate_plugin`` (this folder on PYTHONPATH). Traces the files named in
``MUTATE_TRACE_FILES`` in this process and in the processes a test starts (see sitecustomize.py beside
this file), and writes to ``MUTATE_MAP_OUT`` when the session ends: ``{"tests": {nodeid: [seconds,
passed]}, "lines": {file: {line: [test index]}}, "sources": {file: text}}``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import pytest
from sitecustomize import LineTracer

_files = set(os.environ.get("MUTATE_TRACE_FILES", "").split(os.pathsep)) - {""}
_tracer = LineTracer(_files)
_tests: dict[str, list[Any]] = {}
_lines: dict[str, dict[int, list[int]]] = {}


def _clear_caches() -> None:
    """Empty the ``lru_cache`` s of xcp's modules before each test: a result cached by an earlier test would
    hide the lines that compute it from this one (the mutants of those lines would run without it)."""
    import sys

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("xcp", "xcp_cuda", "xcp_npu"):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
                    value.cache_clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    out = tempfile.mkdtemp(prefix="mutate-trace-")
    os.environ["MUTATE_TRACE_OUT"] = out
    _tracer.take()
    _clear_caches()
    _tracer.start()
    start = time.perf_counter()
    _tests[item.nodeid] = [0.0, True]
    try:
        yield
    finally:
        _tracer.stop()
        _tests[item.nodeid][0] = round(time.perf_counter() - start, 3)
        lines = _tracer.take()
        for name in os.listdir(out):
            with open(os.path.join(out, name)) as f:
                lines.update((file, line) for file, line in json.load(f))
        shutil.rmtree(out, ignore_errors=True)
        del os.environ["MUTATE_TRACE_OUT"]
        index = len(_tests) - 1
        for file, line in lines:
            _lines.setdefault(file, {}).setdefault(line, []).append(index)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and report.nodeid in _tests:
        _tests[report.nodeid][1] = False


def pytest_sessionfinish(session: pytest.Session) -> None:
    sources = {}
    for file in _files:
        with open(file) as f:
            sources[file] = f.read()
    with open(os.environ["MUTATE_MAP_OUT"], "w") as f:
        json.dump({"files": sorted(_files), "tests": _tests, "lines": _lines, "sources": sources}, f)
