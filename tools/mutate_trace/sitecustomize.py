"""Line tracing for tools/mutate.py's line map, started in every Python process that imports it.

tools/mutate.py puts this folder first on PYTHONPATH while it builds the line map, so each process a test
starts (gloo ranks, the CLI, torchrun) imports this file at start-up. When ``MUTATE_TRACE_FILES`` names the
traced source files and ``MUTATE_TRACE_OUT`` a folder, the lines of those files that the process executes
are written there when it exits; the pytest plugin beside this file reads them back for the running test.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any


class LineTracer:
    """Records (file, line) for the executed lines of a fixed set of files, in every thread."""

    def __init__(self, files: set[str]) -> None:
        self.files = files
        self.lines: set[tuple[str, int]] = set()
        self._wanted: dict[Any, bool] = {}

    def _local(self, frame: Any, event: str, arg: Any) -> Callable | None:
        if event == "line":
            self.lines.add((frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Callable | None:
        code = frame.f_code
        wanted = self._wanted.get(code)
        if wanted is None:
            wanted = self._wanted[code] = os.path.realpath(code.co_filename) in self.files
        if not wanted:
            return None
        self.lines.add((code.co_filename, frame.f_lineno))
        return self._local

    def start(self) -> None:
        threading.settrace(self._global)
        sys.settrace(self._global)

    def stop(self) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]

    def take(self) -> set[tuple[str, int]]:
        """The lines recorded since the last take, as real paths."""
        lines, self.lines = self.lines, set()
        return {(os.path.realpath(f), n) for f, n in lines}


def _start_in_subprocess() -> None:
    files = os.environ.get("MUTATE_TRACE_FILES")
    out = os.environ.get("MUTATE_TRACE_OUT")
    if not files or not out:
        return
    tracer = LineTracer(set(files.split(os.pathsep)))
    tracer.start()

    def dump() -> None:
        tracer.stop()
        lines = sorted(tracer.take())
        if lines:
            with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
                json.dump(lines, f)

    atexit.register(dump)


_start_in_subprocess()
