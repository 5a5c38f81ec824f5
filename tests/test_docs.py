"""Every ```python example of the documentation runs as written, on the CPU, each in its own process.

A block preceded by ``<!-- fragment -->`` (on the line right before its fence) is a fragment on purpose and
is not run; keep such blocks rare. A block whose first line is a comment naming a Python file
(``# mypkg/backend.py``) is also written to that path in a temporary folder, which is the working
directory of every block of its document, so later blocks can import it. A block that calls
``init_process_group`` runs under ``torchrun --nproc-per-node 2`` (gloo); a block that imports pytest and
defines tests runs under pytest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    "README.md",
    "docs/architecture.md",
    "docs/backends.md",
    "docs/lifetime.md",
    "docs/benchmarks.md",
    "docs/design.md",
    "docs/integrations.md",
    "docs/inference.md",
    "docs/serving.md",
    "docs/hybrid.md",
    "examples/xcp-tiled-backend/README.md",
]
FRAGMENT = "<!-- fragment -->"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
FILE_HEADER = re.compile(r"#\s*([\w/]+\.py)\s*$")


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    code: str
    fragment: bool

    @property
    def file(self) -> str | None:
        m = FILE_HEADER.fullmatch(self.code.splitlines()[0].strip()) if self.code.strip() else None
        return m.group(1) if m else None

    def __str__(self) -> str:
        return f"{self.document}:{self.line}"


def python_blocks(document: str) -> list[Block]:
    text = (ROOT / document).read_text()
    blocks = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        before = text[: m.start()].rstrip("\n").splitlines()
        fragment = bool(before) and before[-1].strip() == FRAGMENT
        blocks.append(Block(document, text.count("\n", 0, m.start()) + 1, m.group(2), fragment))
    return blocks


ALL_BLOCKS = [b for d in DOCUMENTS for b in python_blocks(d)]


def test_the_documents_exist_and_have_examples():
    for d in DOCUMENTS:
        assert (ROOT / d).is_file(), d
    assert len(ALL_BLOCKS) >= 8
    fragments = [str(b) for b in ALL_BLOCKS if b.fragment]
    assert len(fragments) <= 2, f"too many blocks marked as fragments: {fragments}"


def test_no_python_block_hides_behind_another_fence_language():
    # A Python example in a plain ``` fence would escape this test.
    for d in DOCUMENTS:
        for m in FENCE.finditer((ROOT / d).read_text()):
            if m.group(1) == "":
                body = m.group(2)
                assert not re.search(r"^(import |from \w+ import )", body, re.M), f"{d}: use ```python"


@pytest.fixture
def document_dir(tmp_path):
    def make(document: str) -> Path:
        for b in python_blocks(document):
            if b.file:
                path = tmp_path / b.file
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(b.code)
        return tmp_path

    return make


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(cwd), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    env.pop("XCP_DEVICE", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if not b.fragment], ids=str)
def test_example_runs(block: Block, document_dir):
    cwd = document_dir(block.document)
    script = cwd / "example_block.py"
    script.write_text(block.code)
    if "init_process_group" in block.code:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    elif re.search(r"^import pytest$", block.code, re.M) and re.search(r"^def test_", block.code, re.M):
        script = script.rename(cwd / "test_example_block.py")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    proc = run(cmd, cwd)
    output = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, f"{block} failed:\n{block.code}\n--- output:\n{output}"


def readme_ci_command(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"^<!-- ci: {name} -->\n```bash\n(.*?)\n```$", text, re.M | re.S)
    assert m, f"README.md: no ```bash block right after <!-- ci: {name} -->"
    return m.group(1)


def test_readme_commands_are_the_ones_ci_runs():
    run_cmd, test_cmd = readme_ci_command("install-and-run"), readme_ci_command("install-and-test")
    for cmd in (run_cmd, test_cmd):
        assert "\n" not in cmd and "pip install torch==2.13.0" in cmd
    assert run_cmd.endswith("xcp run")
    # The tests need the example backend (tests/test_example_backend.py): the command installs it.
    assert "-e examples/xcp-tiled-backend" in test_cmd and test_cmd.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- ci: $1 -->" in ci and "install-and-run install-and-test" in ci and "ruff check ." in ci


def plan_transcripts() -> list[tuple[str, list[str], list[str]]]:
    """Every ```text block of the documents that shows ``$ xcp plan ...``: (where, the arguments, the lines
    shown after the command, but ``...``, which stands for lines left out)."""
    found = []
    for d in DOCUMENTS:
        text = (ROOT / d).read_text()
        for m in FENCE.finditer(text):
            lines = m.group(2).splitlines()
            if m.group(1) == "text" and lines and lines[0].startswith("$ xcp plan "):
                shown = [line for line in lines[1:] if line.strip() and line.strip() != "..."]
                found.append((f"{d}:{text.count(chr(10), 0, m.start()) + 1}", lines[0].split()[3:], shown))
    return found


@pytest.mark.parametrize("where, args, shown", plan_transcripts(), ids=[t[0] for t in plan_transcripts()])
def test_a_plan_transcript_shows_what_the_command_prints(where, args, shown, capsys):
    """``xcp plan`` runs nothing (it computes its tables), so the documents show its output as it is."""
    from xcp.cli import main

    assert main(["plan", *args]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert shown and [line for line in shown if line not in printed] == [], where
