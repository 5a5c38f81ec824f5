"""The ``xcp`` command: run, plan and backends, with tiny sizes."""

from __future__ import annotations

import pytest

from xcp.cli import main


def test_run_checks_and_prints_table(capsys):
    code = main(["run", "--world", "2", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"])
    text = capsys.readouterr().out
    assert code == 0, text
    for name in ("out", "dq", "dk", "dv", "peak ring buffers per rank", "PASS"):
        assert name in text


def test_run_float64_non_causal_stripe(capsys):
    args = ["run", "--world", "3", "--seq", "48", "--heads", "2", "--kv-heads", "1", "--head-dim", "5",
            "--dtype", "float64", "--no-causal", "--balance", "stripe"]  # fmt: skip
    assert main(args) == 0
    assert "full" in capsys.readouterr().out


def test_run_bad_sequence_is_a_clear_error(capsys):
    assert main(["run", "--world", "4", "--seq", "60"]) == 2
    err = capsys.readouterr().err
    assert "needs a positive multiple of 8" in err and "got 60" in err


def test_run_rejects_non_positive(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--world", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_plan_table(capsys):
    assert main(["plan", "--world", "4", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "diagonal" in text and "lower" in text and "upper" in text
    rows = text.splitlines()[3:7]  # title, legend, header, then one row per step
    assert [row.count("src ") for row in rows] == [4, 4, 4, 4]


def test_plan_plot(tmp_path, capsys):
    path = tmp_path / "plan.png"
    assert main(["plan", "--world", "3", "--balance", "stripe", "--causal", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_backends_lists_cpu(capsys):
    assert main(["backends"]) == 0
    assert "cpu" in capsys.readouterr().out


def test_sanitize_clean_run_exits_zero(capsys):
    assert main(["sanitize", "--world", "3", "--backward", "--balance", "stripe", "--handoff", "clone"]) == 0
    text = capsys.readouterr().out
    assert "no finding" in text and "bound 4" in text


def test_sanitize_keep_all_is_a_finding(capsys):
    assert main(["sanitize", "--world", "4", "--policy", "keep_all"]) == 1
    assert "[bound]" in capsys.readouterr().out


def test_run_under_torchrun_uses_the_process_group(tmp_path):
    """With RANK/WORLD_SIZE set (torchrun), ``xcp run`` runs on the real gloo process group."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "xcp.cli",
           "run", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("torch.distributed (gloo), rank") == 2
    assert proc.stdout.count("PASS") == 2
