"""The ``xcp`` command: run, plan and backends, with tiny sizes."""

from __future__ import annotations

import pytest
import torch

import xcp
from xcp.backends.cpu import CPUBackend
from xcp.cli import main
from xcp.hookspecs import hookimpl
from xcp.plugins import backend_table, register_plugin, unregister_plugin


def test_run_checks_and_prints_table(capsys):
    code = main(["run", "--world", "2", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"])
    text = capsys.readouterr().out
    assert code == 0, text
    for name in ("out", "dq", "dk", "dv", "peak ring buffers per rank", "PASS"):
        assert name in text


def test_run_times_a_warm_call_apart_from_the_first(monkeypatch):
    """The speed xcp run shows is a warm call's: every rank calls attention twice, each call timed on its own,
    and the table shows the second as the time and the first (plans built, first launches) on a line of its
    own. The clock is injected: each rank thread reads 0 and 7 s around its first call, 100 and 100.25 s
    around its second."""
    import threading

    from xcp.cli import run

    ticks, readings, calls = (0.0, 7.0, 100.0, 100.25), {}, []

    def clock() -> float:
        n = readings.get(threading.get_ident(), 0)
        readings[threading.get_ident()] = n + 1
        return ticks[n]

    def counted(*args, **kw):
        calls.append(threading.get_ident())
        return xcp.attention(*args, **kw)

    monkeypatch.setattr(run, "attention", counted)
    cfg = run.RunConfig(world=2, seq=64, heads=4, kv_heads=2, head_dim=8, dtype="float32", device="cpu")
    result = run.run_demo(cfg, clock)
    text = result.table()
    assert sorted(readings.values()) == [4, 4] and sorted(calls.count(t) for t in set(calls)) == [2, 2]
    assert result.seconds == 0.25 and result.first_seconds == 7.0
    assert "time (fwd+bwd, warm call, slowest rank): 250.00 ms" in text
    assert "first call (plan building, first launches): 7.000 s" in text
    assert result.ok and "PASS" in text


def test_run_float64_non_causal_stripe(capsys):
    args = ["run", "--world", "3", "--seq", "48", "--heads", "2", "--kv-heads", "1", "--head-dim", "5",
            "--dtype", "float64", "--no-causal", "--balance", "stripe"]  # fmt: skip
    assert main(args) == 0
    assert "full" in capsys.readouterr().out


def test_run_bad_sequence_is_a_clear_error(capsys):
    """Refused up front, naming the flag (not the x.shape[1] of the rank that would have raised)."""
    assert main(["run", "--world", "4", "--seq", "100"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("error: --seq: balance 'zigzag' over 4 ranks needs a positive multiple of 8; got 100\n")
    assert "x.shape" not in err and "LocalWorld" not in err


def test_run_rejects_non_positive(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--world", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_plan_table(capsys):
    assert main(["plan", "--world", "4", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "D diagonal" in text and "L lower" in text and "U upper" in text
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("step"))
    assert lines[head].split() == ["step", "r0", "r1", "r2", "r3", "kv", "peers"]
    rows = [line.split() for line in lines[head + 1 : head + 5]]  # one row per step: 4 cells, then the peers
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[0][1:9] == ["0D", "0.50", "1D", "0.50", "2D", "0.50", "3D", "0.50"]
    assert rows[1][1:3] == ["3U", "0.50"] and rows[1][3:5] == ["0L", "0.50"]
    assert [" ".join(r[9:]) for r in rows] == ["->r+1 <-r-1"] * 3 + ["none"]


@pytest.mark.parametrize("world", [2, 5, 8, 16, 33])
@pytest.mark.parametrize("balance", ["zigzag", "contiguous", "stripe"])
def test_plan_table_fits_100_columns_and_keeps_every_cell(capsys, world, balance):
    assert main(["plan", "--world", str(world), "--causal", "--balance", balance]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    heads = [line.split() for line in lines if line.startswith("step")]
    assert sorted(int(c[1:]) for h in heads for c in h[1:-2]) == list(range(world))  # every rank, once
    rows = [line for line in lines if line[:1].isdigit()]
    assert len(rows) == world * len(heads)  # one row per step in each block of ranks


def test_plan_skip_cells_and_totals(capsys):
    assert main(["plan", "--world", "4", "--causal", "--balance", "contiguous"]) == 0
    text = capsys.readouterr().out
    assert "x skip" in text and "F full" in text and "3x 0.00" in text
    assert next(line for line in text.splitlines() if line.startswith("total")).split() == [
        "total", "0.50", "1.50", "2.50", "3.50"]  # fmt: skip


def test_plan_plot(tmp_path, capsys):
    path = tmp_path / "plan.png"
    assert main(["plan", "--world", "3", "--balance", "stripe", "--causal", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_plot_colours_by_share_of_work_and_fills_the_figure(tmp_path, capsys):
    """Contiguous causal: skipped (0), diagonal (0.5) and full (1) cells get the colours of their share,
    and no third of the figure is left blank."""
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("matplotlib.image")
    from matplotlib import colormaps

    path = tmp_path / "plan.png"
    assert main(["plan", "--world", "4", "--balance", "contiguous", "--causal", "--plot", str(path)]) == 0
    rgb = image.imread(str(path))[..., :3]
    for share in (0.0, 0.5, 1.0):
        colour = np.array(colormaps["viridis"](share)[:3])
        close = (np.abs(rgb - colour).max(axis=-1) < 0.02).mean()
        assert close > 0.02, f"share {share}: {close:.3f} of the pixels have its colour"
    blank_columns = (rgb.min(axis=(0, 2)) > 0.98).mean()
    assert blank_columns < 0.15


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


@pytest.mark.parametrize(
    "extra",
    [[], ["--decode", "2", "--chunk", "3"], ["--seq", "19", "--documents", "5,1,13", "--balance", "document_zigzag"]],
    ids=["ring", "decode", "document_zigzag"],
)
def test_run_under_torchrun_uses_the_process_group(tmp_path, extra):
    """With RANK/WORLD_SIZE set (torchrun), ``xcp run`` runs on the real gloo process group; with --decode,
    each process's KVCache combines over it; under document_zigzag, shards of 10 and 9 tokens are gathered."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "xcp.cli",
           "run", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("torch.distributed (gloo), rank") == 1  # rank 0 alone prints the report
    assert "rank 0 of 2" in proc.stdout
    assert proc.stdout.count("PASS") == 1
    if "--decode" in extra:  # every step checked, with the tokens each process holds
        rows = decode_rows(proc.stdout)
        assert list(rows) == ["prefill", "decode 1", "decode 2", "chunk"] and rows["chunk"][3] == [35, 34]


@pytest.mark.parametrize(("rank", "flags", "prints"), [("0", [], True), ("1", [], False), ("1", ["--all-ranks"], True)])
def test_under_torchrun_only_rank_0_prints_unless_all_ranks(capsys, monkeypatch, rank, flags, prints):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["plan", "--world", "2", *flags]) == 0
    assert ("ring plan" in capsys.readouterr().out) == prints


# --- backends by name (issue 10, item 8) ---


class _RenamedCPU(CPUBackend):
    name = "cli-test-cpu"  # a plug-in backend whose name is no torch device type


class _SwitchedOff(CPUBackend):
    name = "cli-test-off"

    def available(self):
        return False, "switched off for the test"


class _TestPlugin:
    @hookimpl
    def xcp_register_backends(self, register):
        register(_RenamedCPU())
        register(_SwitchedOff())


@pytest.fixture
def test_backends():
    plugin = _TestPlugin()
    register_plugin(plugin, "cli-test")
    yield
    unregister_plugin(plugin)


SMALL = ["--seq", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "4", "--world", "2"]


def test_run_accepts_a_backend_name(capsys, test_backends):
    assert main(["run", "--device", "cli-test-cpu", *SMALL]) == 0
    text = capsys.readouterr().out
    assert "device cli-test-cpu" in text and "PASS" in text


@pytest.mark.parametrize("device", ["nosuch", "cli-test-off", "cuda", "npu", "cli-test-cpu:x"])
@pytest.mark.parametrize("tool", ["run", "bench"])
def test_unknown_or_unusable_backend_is_xcps_error_with_the_table(capsys, test_backends, tool, device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("cuda is usable here")
    if device == "npu" and any(r.name == "npu" and r.available for r in backend_table()):
        pytest.skip("npu is usable here")
    args = SMALL if tool == "run" else ["--seqs", "32", "--worlds", "2", "--memory-seq", "32", "--quiet"]
    assert main([tool, "--device", device, *args]) == 2  # an exception would fail the test: no traceback
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"xcp {tool}: error: ")
    if device.endswith(":x"):
        assert "expected a backend name, optionally with :INDEX" in captured.err
    else:
        assert f"backend {device!r} is" in captured.err
        assert "installed backends:" in captured.err and "cpu: available" in captured.err
        assert "cli-test-off: switched off for the test" in captured.err


# --- version, python -m xcp, argument errors, help (issue 10, items 12 and 13) ---


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"xcp {xcp.__version__}"


def test_python_dash_m_xcp_is_the_command(tmp_path):
    import subprocess
    import sys

    version = subprocess.run([sys.executable, "-m", "xcp", "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"xcp {xcp.__version__}"
    plan = subprocess.run([sys.executable, "-m", "xcp", "plan", "--world", "2"], capture_output=True, text=True,
                          cwd=tmp_path)  # fmt: skip
    assert plan.returncode == 0 and plan.stdout.startswith("ring plan: world 2")
    bad = subprocess.run([sys.executable, "-m", "xcp", "plan", "--world", "x"], capture_output=True, text=True,
                         cwd=tmp_path)  # fmt: skip
    assert bad.returncode == 2 and "usage: xcp plan" in bad.stderr


@pytest.mark.parametrize("tool", ["run", "plan", "sanitize"])
def test_bad_integer_names_the_flag_and_shows_the_subcommand_usage(capsys, tool):
    with pytest.raises(SystemExit) as exit_:
        main([tool, "--world", "abc"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: xcp {tool} ")
    assert "--world: expected an integer >= 1; got 'abc'" in err
    assert "invalid" not in err


@pytest.mark.parametrize(
    ("tool", "shown"),
    [
        ("run", ["(default: 3072)", "(default: 4)", "(default: float32)", "(default: cpu)"]),
        ("sanitize", ["(default: bounded)", "(default: float64)"]),
        ("plan", ["(default: zigzag)"]),
        ("bench", ["(default: 2,4,8)", "512,1024,2048 when the backend's device type is cpu", "(default: 5)"]),
    ],
)
def test_help_shows_the_defaults(capsys, tool, shown):
    with pytest.raises(SystemExit):
        main([tool, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in shown:
        assert default in text
    assert "(default: None)" not in text


# --- xcp plan --documents (issue 11) ---


def brute_force_pairs(lengths, world, rank, src, causal, balance):
    """(query, key) pairs of rank's queries against src's keys that the document mask allows."""
    from xcp.cli.packing import boundaries
    from xcp.schedule import DOCUMENT_BALANCES, shard_indices

    doc = [d for d, n in enumerate(lengths) for _ in range(n)]
    seq, cu = len(doc), boundaries(lengths) if balance in DOCUMENT_BALANCES else None
    queries, keys = (shard_indices(seq, world, r, balance, cu) for r in (rank, src))
    return sum(doc[i] == doc[j] and (not causal or j <= i) for i in queries for j in keys)


@pytest.mark.parametrize(
    ("world", "balance", "causal", "lengths"),
    [
        (4, "zigzag", True, [3, 9, 1, 1, 18]),
        (4, "zigzag", False, [3, 9, 1, 1, 18]),
        (3, "stripe", True, [1, 7, 2, 1, 1]),
        (4, "contiguous", True, [5, 1, 10]),
        (2, "zigzag", True, [12]),
        (5, "stripe", False, [1] * 10),
        (4, "contiguous", True, [4, 8, 8, 8, 4]),  # the ring stops after 2 steps
        (3, "zigzag", True, [2] * 6),  # after 1 step: nothing moves
        (4, "document_zigzag", True, [3, 9, 1, 1, 18]),  # each document zigzagged over the ranks
    ],
)
def test_plan_documents_work_is_the_brute_force_count_of_allowed_pairs(capsys, world, balance, causal, lengths):
    from xcp.cli.packing import boundaries
    from xcp.cli.plan import document_blocks

    seq, local = sum(lengths), sum(lengths) // world
    blocks = document_blocks(boundaries(lengths), world, causal, balance)
    expected = [[brute_force_pairs(lengths, world, r, (r - i) % world, causal, balance) for r in range(world)]
                for i in range(world)]  # fmt: skip
    steps = len(blocks)  # the ring may stop early: every later block is empty on every rank
    assert 1 <= steps <= world and (steps == world or any(expected[steps - 1])) and not any(map(any, expected[steps:]))
    expected = expected[:steps]
    assert [[b.pairs for b in row] for row in blocks] == expected
    for i, row in enumerate(blocks):
        for r, b in enumerate(row):
            assert b.src == (r - i) % world and b.work == expected[i][r] / local**2
            assert (b.kind == "empty") == (b.pairs == 0) == (b.calls == 0)
            assert b.calls <= b.segments
    totals = [sum(expected[i][r] for i in range(steps)) for r in range(world)]
    assert sum(totals) == brute_force_pairs(lengths, 1, 0, 0, causal, "contiguous")  # every allowed pair once

    flags = ["--causal"] if causal else []
    assert main(["plan", "--world", str(world), "--balance", balance, *flags,
                 "--documents", ",".join(map(str, lengths))]) == 0  # fmt: skip
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].endswith(f"balance {balance}, {len(lengths)} packed documents")
    assert lines[1].startswith(f"documents: S = {seq} tokens ({local} per rank), lengths ")
    total_line = next(line for line in lines if line.startswith("total")).split()[1:]
    assert total_line == [f"{t / local**2:.2f}" for t in totals]
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert len(rows) == steps
    for i, row in enumerate(rows):  # per cell: <src><kind> <calls>/<segments> <share>
        assert row[3 : 3 * world + 1 : 3] == [f"{e / local**2:.2f}" for e in expected[i]]
        assert row[1 : 3 * world : 3] == [f"{b.src}{b.code}" for b in blocks[i]]
        assert row[2 : 3 * world : 3] == [f"{b.calls}/{b.segments}" for b in blocks[i]]
    mean = sum(totals) / world
    ratio = max(totals) / mean if mean else 1.0
    assert f"max/mean {ratio:.3f}" in text


def test_plan_documents_zigzag_example(capsys):
    """The issue's example: each step x rank cell says empty (x), full (F) or causal (C), with its calls,
    and the rank totals are unbalanced by the documents although the dense plan is not."""
    assert main(["plan", "--world", "4", "--causal", "--documents", "3000,9000,4384"]) == 0
    text = capsys.readouterr().out
    assert "block kinds: x empty, F full (unmasked segments), C causal (square-causal segments)" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line[:1].isdigit() or
            line.startswith(("total", "calls"))}  # fmt: skip
    assert rows["0"][:9:3] == ["0C", "1C", "2C"] and rows["1"][0:3] == ["3x", "0/0", "0.00"]
    assert rows["1"][3:6] == ["0F", "1/1", "0.12"]
    assert rows["calls"] == ["3/4", "3/5", "3/4", "3/3"]
    assert "max/mean 1.558 (1 = balanced; 1.000 without documents)" in text
    assert max(len(line) for line in text.splitlines()) <= 100


@pytest.mark.parametrize(("world", "seq", "spec"), [(8, 2048, "longtail:8:200"), (16, 1 << 20, "longtail:1:2000000")])
def test_plan_documents_fits_100_columns(capsys, world, seq, spec):
    assert main(["plan", "--world", str(world), "--causal", "--documents", spec, "--seq", str(seq)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    heads = [line.split() for line in lines if line.startswith("step")]
    assert sorted(int(c[1:]) for h in heads for c in h[1:-2]) == list(range(world))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--documents", "3000,9000,4385"],
         "--documents: expected lengths summing to a multiple of 8 (balance 'zigzag' over 4 ranks needs it); "
         "got a sum of 16385 (nearest: 16384 or 16392)"),
        (["--documents", "3000,9000,4384", "--seq", "16000"],
         "--documents: expected lengths summing to --seq 16000; got 3 lengths summing to 16384"),
        (["--documents", "longtail:16:64"], "--documents: 'longtail:16:64' draws lengths to fill the sequence; "
         "expected --seq too"),
        (["--documents", "longtail:16:64", "--seq", "100"],
         "--seq: balance 'zigzag' over 4 ranks needs a positive multiple of 8; got 100"),
        (["--seq", "60"], "--seq: balance 'zigzag' over 4 ranks needs a positive multiple of 8; got 60"),
    ],
)  # fmt: skip
def test_plan_bad_documents_name_the_flag_the_expected_and_the_actual(capsys, args, message):
    assert main(["plan", "--world", "4", "--causal", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"xcp plan: error: {message}")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3,x", "--documents: expected comma-separated document lengths (integers >= 1, summing to S) or "
                "longtail:MIN:MAX[:SEED]; got '3,x'"),
        ("4,0,4", "got '4,0,4' (a length below 1)"),
        ("longtail:64:8", "--documents: expected longtail:MIN:MAX[:SEED] with integers 1 <= MIN <= MAX"),
        ("longtail:8", "got 'longtail:8'"),
    ],
)  # fmt: skip
def test_plan_unparsable_documents_is_a_usage_error(capsys, value, message):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--world", "2", "--documents", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: xcp plan ") and message in err


def test_longtail_lengths_are_seeded_bounded_and_fill_the_sequence():
    from xcp.cli.packing import longtail_lengths, parse_documents

    lengths = longtail_lengths(65536, 512, 32768, seed=3)
    assert sum(lengths) == 65536 and lengths == longtail_lengths(65536, 512, 32768, seed=3)
    assert all(512 <= n <= 32768 for n in lengths[:-1]) and 1 <= lengths[-1] <= 32768
    assert longtail_lengths(65536, 512, 32768, seed=4) != lengths
    spec = parse_documents("longtail:512:32768:3")
    assert spec.draw(65536) == lengths and parse_documents("longtail:512:32768").seed == 0
    many = longtail_lengths(1 << 22, 1, 1024)  # log-uniform: as many lengths below 32 as above
    assert 0.35 < sum(n < 32 for n in many) / len(many) < 0.65


def test_plan_documents_plot(tmp_path, capsys):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("matplotlib.image")
    path = tmp_path / "docs.png"
    assert main(["plan", "--world", "4", "--causal", "--documents", "3000,9000,4384", "--plot", str(path)]) == 0
    assert f"plot written to {path}" in capsys.readouterr().out
    rgb = image.imread(str(path))[..., :3]
    assert rgb.shape[0] > 100 and (np.abs(rgb - rgb[0, 0]).max() > 0.5)


def test_sanitize_documents_runs_the_ring_over_packed_documents(capsys):
    assert main(["sanitize", "--world", "4", "--backward", "--documents", "6", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert "documents=6" in text and "documents: 6 packed, lengths " in text
    assert "with the document mask: out" in text and "no finding" in text and "bound 4" in text


def test_sanitize_too_many_documents_is_a_clear_error(capsys):
    assert main(["sanitize", "--world", "2", "--seq", "8", "--documents", "9"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "xcp sanitize: error: --documents: expected at most --seq 8 documents (each at least 1 token); got 9\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sanitize", "--seq", "10", "--balance", "contiguous"],
         "--seq: balance 'contiguous' over 4 ranks needs a positive multiple of 4; got 10"),
        (["sanitize", "--seq", "3", "--balance", "document_zigzag", "--documents", "2"],
         "--seq: balance 'document_zigzag' over 4 ranks needs at least 4 tokens (one per rank); got 3"),
        (["sanitize", "--kv-heads", "3"], "--kv-heads: expected a divisor of --heads 4; got 3"),
        (["sanitize", "--chunk", "3"],
         "--chunk: expected together with --decode (only the decode path reads it); got --chunk 3 without --decode"),
        (["sanitize", "--capacity"], "--capacity: expected together with --decode (only the decode path reads it); "
         "got --capacity without --decode"),
        (["run", "--chunk", "3"], "--chunk: expected together with --decode"),
        (["plan", "--world", "4", "--chunk", "3"], "--chunk: expected together with --decode"),
        (["run", "--kv-heads", "3"], "--kv-heads: expected a divisor of --heads 8; got 3"),
    ],
)  # fmt: skip
def test_sanitize_errors_name_the_flags_as_typed(capsys, args, message):
    """The sanitizer's own errors name its arguments (seq, kv_heads); xcp sanitize's name the flags; a flag of
    the decode path alone is refused without --decode, in every tool that has it."""
    _fails_with_usage_error(capsys, args, message)


# --- sliding windows (issue 12): steps and bytes in xcp plan, the sanitizer, clear errors ---


def brute_force_steps(seq, world, balance, causal, window, lengths=None):
    """The fewest steps a ring needs: one more than the last step at which some rank has a (query, key)
    pair its mask allows, the window, documents and causality all checked pair by pair."""
    from xcp.schedule import shard_indices

    doc = [d for d, n in enumerate(lengths or [seq]) for _ in range(n)]
    left, right = (seq if x is None else x for x in window)

    def allowed(i, j):
        return doc[i] == doc[j] and i - left <= j <= i + right and (not causal or j <= i)

    last = 0
    for r in range(world):
        queries = shard_indices(seq, world, r, balance)
        for step in range(world):
            keys = shard_indices(seq, world, (r - step) % world, balance)
            if any(allowed(i, j) for i in queries for j in keys):
                last = max(last, step)
    return last + 1


def cost_rows(text):
    """The ring-cost table of xcp plan: {row name: (this ring, dense ring)} with bytes as ints."""
    import re

    rows = {}
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ring cost:"))
    for line in lines[start:]:
        for name in ("steps", "forward K/V", "backward K/V", "backward dK/dV", "fwd+bwd total"):
            if line.startswith(f"  {name}  "):
                cells = line[2 + len(name) :].strip()
                if name == "steps":
                    rows[name] = tuple(re.findall(r"(\d+) of \d+", cells))
                    rows[name] = tuple(map(int, rows[name]))
                else:  # "448.0 MiB (469762048 B)" or "512 B"
                    rows[name] = tuple(int(a or b) for a, b in re.findall(r"\((\d+) B\)|(?<![(\d.])(\d+) B", cells))
    return rows


@pytest.mark.parametrize(
    ("world", "seq", "balance", "causal", "window", "lengths", "dtype"),
    [
        (4, 64, "contiguous", True, (8, 0), None, "float32"),  # 2 of 4 steps
        (4, 64, "zigzag", True, (8, 0), None, "bfloat16"),  # zigzag reaches the far end: all 4
        (4, 64, "contiguous", True, (0, 0), None, "float64"),  # the own shard only: nothing moves
        (4, 64, "contiguous", False, (3, 20), None, "float16"),  # two-sided: 3 of 4 steps
        (8, 64, "stripe", False, (None, 2), None, "float32"),
        (4, 64, "contiguous", True, (40, None), [5, 1, 30, 28], "float32"),  # documents and a window
        (3, 48, "contiguous", True, (2, 0), [10, 38], "bfloat16"),
    ],
)
def test_plan_window_steps_are_the_brute_force_minimum_and_bytes_the_formula(
    capsys, world, seq, balance, causal, window, lengths, dtype
):
    from xcp.cli.windows import text_of

    kv_heads, head_dim = 2, 8
    args = ["plan", "--world", str(world), "--seq", str(seq), "--balance", balance, "--window", text_of(window),
            "--heads", "4", "--kv-heads", str(kv_heads), "--head-dim", str(head_dim), "--dtype", dtype]  # fmt: skip
    if causal:
        args.append("--causal")
    if lengths:
        args += ["--documents", ",".join(map(str, lengths))]
    assert main(args) == 0
    text = capsys.readouterr().out
    m = brute_force_steps(seq, world, balance, causal, window, lengths)
    rows = [line.split()[0] for line in text.splitlines() if line[:1].isdigit()]
    assert rows == [str(i) for i in range(m)] * (len(rows) // m)  # the ring's m steps, no more, in every block
    cost = cost_rows(text)
    assert cost["steps"] == (m, world)
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    acc = 8 if dtype == "float64" else 4
    shard, message = 2 * (seq // world) * kv_heads * head_dim * item, 2 * (seq // world) * kv_heads * head_dim * acc
    for col, steps in enumerate((m, world)):  # this ring, then the dense ring
        assert cost["forward K/V"][col] == (steps - 1) * shard
        assert cost["backward K/V"][col] == (steps - 1) * shard
        assert cost["backward dK/dV"][col] == (steps * message if steps > 1 else 0)
        parts = ("forward K/V", "backward K/V", "backward dK/dV")
        assert cost["fwd+bwd total"][col] == sum(cost[k][col] for k in parts)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert f"sliding {text_of(window if not causal else (window[0], 0))}" in text.splitlines()[0]
    assert "recommends" in text and "<- " in text
    if m < world:
        assert f"the ring stops after {m} of {world} steps" in text or m == 1


def test_plan_window_the_issues_configuration(capsys):
    """S = 128K, window 4K, causal, P = 8: contiguous runs 2 of 8 steps and sends a seventh of the dense
    ring's K/V; zigzag runs all 8; xcp.choose_balance recommends contiguous, and --balance auto takes it."""
    base = ["plan", "--world", "8", "--causal", "--seq", "131072", "--window", "4096,0"]
    assert main([*base, "--balance", "auto"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("--balance auto: xcp.choose_balance recommends contiguous\n")
    assert "ring plan: world 8, causal attention, balance contiguous, sliding 4096,0" in text
    assert "B banded (sliding-window segments)" in text
    assert "a K/V shard is 2·(S/P)·Hkv·D·itemsize = 2·16384·8·128·2 (bfloat16) = 64.0 MiB" in text
    cost = cost_rows(text)
    assert cost["steps"] == (2, 8)
    assert cost["forward K/V"] == (64 << 20, 7 * (64 << 20))
    assert cost["backward dK/dV"] == (2 * (128 << 20), 8 * (128 << 20))
    assert "  contiguous busiest 1.02x even, 2 calls, cost 1.52, 2/8 steps  <- recommended, this plan" in text
    assert "  zigzag     busiest 1.02x even, 4 calls, cost 2.03, 8/8 steps" in text
    assert main(base) == 0  # zigzag, the default
    assert cost_rows(capsys.readouterr().out)["steps"] == (8, 8)


def test_plan_seq_alone_prints_the_dense_rings_cost(capsys):
    assert main(["plan", "--world", "4", "--causal", "--seq", "64", "--kv-heads", "1", "--head-dim", "4",
                 "--dtype", "float32"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "D diagonal" in text and "balance: xcp.choose_balance" not in text
    cost = cost_rows(text)
    assert cost["steps"] == (4, 4) and cost["forward K/V"] == (3 * 512, 3 * 512)
    assert cost["backward dK/dV"] == (4 * 512, 4 * 512)


def test_sanitize_window_runs_the_short_ring_and_says_so(capsys):
    assert main(["sanitize", "--world", "4", "--backward", "--balance", "contiguous", "--window", "3,0"]) == 0
    text = capsys.readouterr().out
    assert "window=3,0" in text and "window 3,0: query i sees keys i-3..i; the ring ran 2 of 4 steps" in text
    assert "with the banded mask: out" in text and "no finding" in text and "bound 4" in text
    assert main(["sanitize", "--world", "4", "--no-causal", "--documents", "5", "--window", "2,none"]) == 0
    text = capsys.readouterr().out
    assert "the ring ran 4 of 4 steps" in text and "with the banded document mask" in text


def _fails_with_usage_error(capsys, args: list[str], message: str) -> None:
    """``xcp args`` exits 2, prints nothing on stdout, and its stderr starts with the tool's usage error."""
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"xcp {args[0]}: error: {message}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--world", "4", "--causal", "--seq", "64", "--window", "4,2"],
         "--window: with a causal mask R must be 0 or none (no query sees a later key); got 4,2"),
        (["plan", "--world", "4", "--causal", "--seq", "64", "--window", "none,0"],
         "--window: none,0 with a causal mask bounds nothing: it is the dense ring; leave --window out"),
        (["plan", "--world", "4", "--seq", "64", "--window", "none,none"],
         "--window: none,none with no mask bounds nothing"),
        (["plan", "--world", "4", "--window", "4,0"],
         "--window: expected --seq (or --documents) too: a window's plan depends on S"),
        (["plan", "--world", "4", "--window", "4,0", "--seq", "64", "--kv-heads", "3"],
         "--kv-heads: expected a divisor of --heads 32; got 3"),
        (["sanitize", "--window", "4,1"], "--window: with a causal mask R must be 0 or none"),
        (["bench", "--device", "cpu", "--window", "4,1", "--mask", "causal", "--seqs", "16"],
         "--window: with a causal mask R must be 0 or none"),
        (["bench", "--device", "cpu", "--window", "4,0", "--batch", "2", "--seqs", "16"],
         "--batch: expected 1 with --window"),
        (["bench", "--device", "cpu", "--window", "4,0", "--distributed"],
         "--window: not measured with --distributed yet; got '4,0'"),
        (["bench", "--device", "cpu", "--balance", "auto", "--distributed"],
         "--balance: --distributed measures zigzag only yet; got 'auto'"),
    ],
)  # fmt: skip
def test_bad_window_values_name_the_flag(capsys, args, message):
    _fails_with_usage_error(capsys, args, message)


@pytest.mark.parametrize("tool", ["plan", "sanitize", "bench"])
@pytest.mark.parametrize("value", ["4", "4,x", "-1,0", "1,2,3", ""])
def test_unparsable_window_is_a_usage_error(capsys, tool, value):
    with pytest.raises(SystemExit) as exit_:
        main([tool, f"--window={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: xcp {tool} ")
    assert "argument --window: expected L,R: keys i-L..i+R for query i, each an integer >= 0 or none" in err
    assert f"got {value!r}" in err


# --- the hybrid all-to-all + ring (issue 15): plan, run, sanitize with --ulysses ---


def hybrid_rows(text):
    """The bytes table of xcp plan --ulysses: [(pass, step, sends, bytes per step, steps, bytes)], the pass
    repeated on every row."""
    import re

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  pass      step"))
    cell = r"(?:[\d.]+ \w+ \((\d+) B\)|(\d+) B)"
    rows, phase = [], None
    for line in lines[start + 1 :]:
        if line.startswith("  per rank"):
            break
        phase = line[2:12].strip() or phase
        m = re.fullmatch(rf"\s*{cell}\s+(\d+)\s+{cell}", line[43:])
        assert m, line
        a, b, steps, c, d = m.groups()
        rows.append((phase, line[12:32].strip(), line[32:43].strip(), int(a or b), int(steps), int(c or d)))
    totals = {}
    for line in lines[start + len(rows) + 2 : start + len(rows) + 5]:
        name, cells = line[2:43].strip(), re.findall(cell, line[43:])
        totals[name] = tuple(int(x or y) for x, y in cells)
    return rows, totals


def counted_hybrid_run(world, ulysses, seq, heads, kv_heads, dim, dtype, causal, balance, window, value_dim=None,
                       cu=None):  # fmt: skip
    """xcp.attention(ulysses=...) forward and backward on a LocalWorld, every exchange counted at the
    communicator: per rank, the (pass, tag, bytes sent) of each exchange that sent something, in order (the
    all-to-all sends U - 1 rows in one exchange; the agreement's fingerprint left out). v and dout of
    ``value_dim`` (None: ``dim``); ``cu``: packed documents' boundaries."""
    import threading

    from xcp.cli.common import placement
    from xcp.comm import LocalGroup

    gen = torch.Generator().manual_seed(0)
    dv = dim if value_dim is None else value_dim
    q, dout = (torch.randn(1, seq, heads, d, generator=gen).to(dtype) for d in (dim, dv))
    k, v = (torch.randn(1, seq, kv_heads, d, generator=gen).to(dtype) for d in (dim, dv))
    place = placement(balance, ulysses, cu)
    log: dict[str, list] = {}
    phase = threading.local()
    exchange = LocalGroup.exchange

    def counting(self, sends, recvs, tag, backend, step=None):
        sent = sum(t.numel() * t.element_size() for t, _ in sends)
        if tag != "agree" and sent:
            log.setdefault(threading.current_thread().name, []).append((phase.name, tag, sent))
        return exchange(self, sends, recvs, tag, backend, step)

    def rank_fn(group):
        r = group.rank()
        local = [xcp.shard(t, world, r, **place).requires_grad_() for t in (q, k, v)]
        phase.name = "forward"
        out = xcp.attention(*local, causal=causal, group=group, balance=balance, ulysses=ulysses, window=window,
                            cu_seqlens=None if cu is None else torch.tensor(cu))  # fmt: skip
        phase.name = "backward"
        out.backward(xcp.shard(dout, world, r, **place))
        return threading.current_thread().name

    LocalGroup.exchange = counting
    try:
        names = xcp.LocalWorld(world).run(rank_fn)
    finally:
        LocalGroup.exchange = exchange
    return [log.get(name, []) for name in names]


@pytest.mark.parametrize(
    ("world", "ulysses", "heads", "kv_heads", "dtype", "causal", "balance", "window"),
    [
        (4, 2, 4, 2, "float64", True, "zigzag", None),
        (8, 4, 8, 1, "float32", False, "stripe", None),  # K/V heads replicated 4x
        (4, 4, 4, 2, "float64", True, "zigzag", None),  # pure Ulysses: a ring of one rank
        (8, 2, 4, 2, "float32", True, "contiguous", (3, 0)),  # a window: 2 of 4 ring steps
    ],
)
def test_plan_ulysses_bytes_per_step_are_the_formula_and_what_a_run_sends(
    capsys, world, ulysses, heads, kv_heads, dtype, causal, balance, window
):
    """xcp plan --ulysses: the head groups and rings, and per step and tensor the bytes one rank sends, equal
    to the formula written out here and to what each rank of a LocalWorld run of xcp.attention(ulysses=U)
    sends at each exchange (forward and backward)."""
    import math

    seq, dim = 32, 8
    r = world // ulysses
    args = ["plan", "--world", str(world), "--ulysses", str(ulysses), "--seq", str(seq), "--heads", str(heads),
            "--kv-heads", str(kv_heads), "--head-dim", str(dim), "--dtype", dtype, "--balance", balance]  # fmt: skip
    args += ["--causal"] if causal else []
    args += ["--window", f"{window[0]},{window[1]}"] if window else []
    assert main(args) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 100
    assert f"hybrid all-to-all + ring: world {world} = ulysses {ulysses} x ring {r}" in text
    heads_line = " ".join("{" + ",".join(str(g * ulysses + j) for j in range(ulysses)) + "}" for g in range(r))
    rings_line = " ".join("{" + ",".join(str(g + j * ulysses) for j in range(r)) + "}" for g in range(ulysses))
    assert f"\n  {heads_line}\n" in text and f"\n  {rings_line}\n" in text
    # the formula, written out
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    acc = 8 if dtype == "float64" else 4
    hkv = math.lcm(kv_heads, ulysses)  # K/V heads after replication
    q_bytes = (ulysses - 1) * (seq // world) * heads * dim * item // ulysses
    kv_bytes = (ulysses - 1) * (seq // world) * hkv * dim * item // ulysses
    shard, message = (2 * (seq // r) * (hkv // ulysses) * dim * x for x in (item, acc))
    m = r if window is None else brute_force_steps(seq, r, balance, causal, window)
    assert window is None or m < r
    want = [("forward", "all-to-all in", "q", q_bytes, 1), ("forward", "all-to-all in", "k", kv_bytes, 1),
            ("forward", "all-to-all in", "v", kv_bytes, 1)]  # fmt: skip
    ring = "ring step 0" if m == 2 else f"ring steps 0..{m - 2}"
    want += [("forward", ring, "K/V shard", shard, m - 1)] if m > 1 else [("forward", "ring step 0", "nothing", 0, 1)]
    want += [("forward", "all-to-all out", "out", q_bytes, 1), ("backward", "all-to-all in", "dout", q_bytes, 1)]
    if m > 1:
        want += [
            ("backward", ring, "K/V shard", shard, m - 1),
            ("backward", f"ring steps 0..{m - 1}", "dK/dV", message, m),
        ]
    else:
        want += [("backward", "ring step 0", "nothing", 0, 1)]
    want += [("backward", "all-to-all out", x, n, 1) for x, n in (("dq", q_bytes), ("dk", kv_bytes), ("dv", kv_bytes))]
    rows, totals = hybrid_rows(text)
    assert [row[:5] for row in rows] == want
    assert all(row[5] == row[3] * row[4] for row in rows)
    forward = sum(row[5] for row in rows if row[0] == "forward")
    backward = sum(row[5] for row in rows if row[0] == "backward")
    assert totals["forward total"][0] == forward and totals["fwd+bwd total"][0] == forward + backward
    flat = (world - 1) * 2 * (seq // world) * kv_heads * dim * item  # the ring alone over P (dense) forward
    assert window is not None or totals["forward total"][1] == flat
    # what a run sends, exchange by exchange: the all-to-all of one pass in one exchange, then each ring step
    counted = counted_hybrid_run(world, ulysses, seq, heads, kv_heads, dim, getattr(torch, dtype), causal, balance,
                                 window)  # fmt: skip
    a2a_in, a2a_out = q_bytes + 2 * kv_bytes, q_bytes
    expected = [("forward", "a2a", a2a_in), *[("forward", "kv", shard)] * (m - 1), ("forward", "a2a", a2a_out),
                ("backward", "a2a", a2a_out)]  # fmt: skip
    ring_bwd = [("backward", "kv", shard)] * (m - 1) + [("backward", "dkv", message)] * (m if m > 1 else 0)
    for per_rank in counted:
        got_ring = sorted(x for x in per_rank if x[0] == "backward" and x[1] != "a2a")
        assert [x for x in per_rank if not (x[0] == "backward" and x[1] != "a2a")] == [
            *expected, ("backward", "a2a", a2a_in)]  # fmt: skip
        assert got_ring == sorted(ring_bwd)
        assert sum(x[2] for x in per_rank if x[0] == "forward") == forward
        assert sum(x[2] for x in per_rank if x[0] == "backward") == backward


def test_plan_ulysses_without_seq_shows_groups_and_the_rings_plan(capsys):
    assert main(["plan", "--world", "8", "--ulysses", "2", "--causal"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("hybrid all-to-all + ring: world 8 = ulysses 2 x ring 4\n")
    assert "  {0,1} {2,3} {4,5} {6,7}\n" in text and "  {0,2,4,6} {1,3,5,7}\n" in text
    assert "ring plan: world 4, causal attention, balance zigzag" in text
    assert "give --seq (S) for the bytes each rank sends" in text
    assert main(["plan", "--world", "8", "--ulysses", "1", "--causal"]) == 0  # U = 1: the ring alone, as before
    alone = capsys.readouterr().out
    assert main(["plan", "--world", "8", "--causal"]) == 0
    assert alone == capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--world", "8", "--ulysses", "3"], "--ulysses: expected a divisor of --world 8 (P = ulysses x ring "
         "ranks); got 3"),
        (["plan", "--world", "8", "--ulysses", "4", "--heads", "6", "--kv-heads", "2"],
         "--ulysses: expected a divisor of --heads 6 (each rank of a head group takes heads / ulysses of the query "
         "heads); got 4"),
        (["plan", "--world", "8", "--ulysses", "2", "--seq", "20"],
         "--seq: balance 'zigzag' over 4 ranks needs a positive multiple of 8; got 20"),
        (["plan", "--world", "8", "--ulysses", "2", "--seq", "12", "--balance", "stripe"],
         "--seq: expected a multiple of 8 ranks with --ulysses 2 (each of the 4 ring shards is cut into 2 pieces); "
         "got 12"),
        (["plan", "--world", "8", "--ulysses", "2", "--documents", "10,10"],
         "--documents: expected lengths summing to a multiple of 8 (balance 'zigzag' over 4 ranks needs it)"),
        (["run", "--world", "4", "--ulysses", "3"], "--ulysses: expected a divisor of --world 4"),
        (["run", "--world", "4", "--ulysses", "4", "--heads", "6", "--kv-heads", "2"],
         "--ulysses: expected a divisor of --heads 6"),
        (["run", "--world", "4", "--ulysses", "2", "--seq", "6", "--balance", "stripe"],
         "--seq: expected a multiple of 4 ranks with --ulysses 2 (each of the 2 ring shards is cut into 2 pieces); "
         "got 6"),
        (["sanitize", "--world", "4", "--ulysses", "3"], "--ulysses: expected a divisor of --world 4"),
        (["sanitize", "--world", "4", "--ulysses", "4", "--heads", "6", "--kv-heads", "2"],
         "--ulysses: expected a divisor of --heads 6"),
    ],
)  # fmt: skip
def test_bad_ulysses_values_name_the_flag_the_expected_and_the_actual(capsys, args, message):
    _fails_with_usage_error(capsys, args, message)


@pytest.mark.parametrize("tool", ["plan", "run", "sanitize", "bench"])
def test_ulysses_below_one_is_a_usage_error(capsys, tool):
    with pytest.raises(SystemExit) as exit_:
        main([tool, "--ulysses", "0"] + (["--world", "4"] if tool == "plan" else []))
    assert exit_.value.code == 2
    assert "argument --ulysses: expected" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("world", "ulysses", "extra"),
    [(4, 2, ["--heads", "4", "--kv-heads", "1"]), (4, 4, ["--dtype", "float64", "--no-causal", "--balance", "stripe"])],
)
def test_run_ulysses_checks_the_hybrid_against_the_whole_sequence(capsys, world, ulysses, extra):
    import re

    args = ["run", "--world", str(world), "--ulysses", str(ulysses), "--seq", "64", "--head-dim", "8", *extra]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"hybrid: world {world} = ulysses {ulysses} x ring {world // ulysses}" in text and "PASS" in text
    tol = 1e-10 if "float64" in extra else 1e-4
    for name in ("out", "dq", "dk", "dv"):
        rel = float(re.search(rf"^{name}\s+\S+\s+(\S+)\s+\S+\s+ok$", text, re.M).group(1))
        assert rel <= tol / 10, (name, rel)  # computed against the float64 whole sequence, well inside the bound


def test_run_ulysses_on_the_path_of_virtual_gpu_ranks(reference):
    """On a GPU xcp run drives each virtual rank through hybrid_forward/hybrid_backward (autograd's one device
    thread would block): the same path, run here on the CPU, equals the whole sequence."""
    from xcp.cli.common import random_inputs as tool_inputs
    from xcp.cli.run import RunConfig, rank_step

    cfg = RunConfig(world=4, seq=32, heads=4, kv_heads=1, head_dim=8, dtype="float64", device="cpu", ulysses=2)
    full = tool_inputs(cfg, cfg.seq, torch.device("cpu"))
    results = xcp.LocalWorld(4).run(rank_step, cfg, xcp.get_backend("cpu"), full, True)
    want = reference(*full, True)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = xcp.unshard([r[i] for r in results], ulysses=2)
        torch.testing.assert_close(got, want.tensors()[name], atol=1e-10, rtol=0)


def test_run_ulysses_under_torchrun_uses_the_process_group(tmp_path):
    """2 gloo processes, --ulysses 2 (all-to-all alone: the head group is the default group): the shards are
    placed, gathered and checked as on a LocalWorld (sub-groups of real processes: tests/test_gloo.py)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "xcp.cli",
           "run", "--seq", "64", "--heads", "4", "--kv-heads", "1", "--head-dim", "8", "--ulysses", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch.distributed (gloo), rank 0 of 2" in proc.stdout
    assert "hybrid: world 2 = ulysses 2 x ring 1" in proc.stdout and proc.stdout.count("PASS") == 1


def test_sanitize_ulysses_runs_the_hybrid_and_sets_aside_only_the_peers_rows(capsys):
    assert main(["sanitize", "--world", "6", "--ulysses", "3", "--heads", "6", "--kv-heads", "2", "--backward"]) == 0
    text = capsys.readouterr().out
    assert "ulysses=3" in text and "hybrid: world 6 = ulysses 3 x ring 2" in text and "no finding" in text
    assert "all-to-all receive buffers peak" in text and "bound 4)" in text
    import re

    assert int(re.search(r"set aside: (\d+) report", text).group(1)) > 0  # U >= 3: peers' rows, set aside
    # keep_all breaks the ring's bound inside the hybrid as it does in a ring of R = 4 ranks alone
    assert main(["sanitize", "--world", "8", "--ulysses", "2", "--backward", "--policy", "keep_all"]) == 1
    hybrid = capsys.readouterr().out
    assert main(["sanitize", "--world", "4", "--backward", "--policy", "keep_all"]) == 1
    alone = capsys.readouterr().out
    peak = re.search(r"\[bound\] rank0: (\d+) received shards alive at once \(ledger\); bound 4", alone).group(0)
    assert peak in hybrid and "set aside" not in hybrid  # U = 2: nothing to set aside


# --- inference over a sharded KV cache: xcp run --decode, xcp plan --decode ---


def decode_rows(text):
    """The step rows of ``xcp run --decode``: {name: (T, rel err, result, tokens held per rank)}."""
    import re

    rows = {}
    row = r"^(prefill|decode \d+|chunk)\s+(\d+)\s+\S+\s+(\S+)\s+\S+\s+(ok|FAIL)\s+([\d ]+)$"
    for m in re.finditer(row, text, re.M):
        rows[m.group(1)] = (int(m.group(2)), float(m.group(3)), m.group(4), [int(x) for x in m.group(5).split()])
    return rows


@pytest.mark.parametrize(("world", "extra"), [(4, []), (3, ["--dtype", "float64", "--balance", "stripe"])])
def test_run_decode_checks_every_step_against_the_whole_sequence(capsys, world, extra):
    args = ["run", "--world", str(world), "--seq", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
            "--decode", "3", "--chunk", "5", *extra]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    rows = decode_rows(text)
    assert list(rows) == ["prefill", "decode 1", "decode 2", "decode 3", "chunk"] and text.endswith("PASS\n")
    tol = 1e-10 if "float64" in extra else 1e-4
    seq = 48
    for name, (t, rel, result, held) in rows.items():
        seq += 0 if name == "prefill" else t
        assert result == "ok" and rel <= tol / 10, (name, rel)
        assert held == [seq // world + (r < seq % world) for r in range(world)]  # dealt round-robin: within one


class _Base2Lse(CPUBackend):
    """A backend whose log-sum-exp is base 2 (what kernels that exponentiate with exp2 keep): merges weigh
    the partials wrongly, in the ring and in the cache's combine."""

    name = "cli-test-base2"

    def forward(self, q, k, v, mask, scale):
        out, lse = super().forward(q, k, v, mask, scale)
        return out, lse * 1.4426950408889634


class _Base2Plugin:
    @hookimpl
    def xcp_register_backends(self, register):
        register(_Base2Lse())


def test_run_decode_fails_when_the_lse_is_wrong(capsys):
    plugin = _Base2Plugin()
    register_plugin(plugin, "cli-test-base2")
    try:
        code = main(["run", "--device", "cli-test-base2", "--decode", "2", "--chunk", "3", *SMALL])
    finally:
        unregister_plugin(plugin)
    text = capsys.readouterr().out
    assert code == 1 and "FAIL: an error is above its tolerance" in text
    assert {name: row[2] for name, row in decode_rows(text).items()} == dict.fromkeys(
        ["prefill", "decode 1", "decode 2", "chunk"], "FAIL"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode", "-1"], "--decode: expected an integer >= 0; got -1"),
        (["--decode", "1", "--chunk", "-2"], "--chunk: expected an integer >= 0; got -2"),
        (["--decode", "0", "--chunk", "0"], "--decode: expected a step to run"),
        (["--decode", "1", "--no-causal"], "--decode: expected a causal mask"),
        (["--decode", "1", "--ulysses", "2"], "--decode: expected --ulysses 1"),
        (["--decode", "1", "--seq", "30"], "--seq"),
    ],
)
def test_run_decode_bad_flags_name_the_flag(capsys, args, message):
    assert main(["run", "--world", "2", "--seq", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "4",
                 *args]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("xcp run: error: ") and message in err


def counted_decode(world, prompt, steps, balance, window, heads, dim, dtype, combine="auto", value_dim=None):
    """A KVCache per rank of a LocalWorld, prefilled and appended to as xcp plan --decode plans it; per rank
    and step the tokens held, the kernel calls of the local partial and the bytes sent in the combine
    (counted at the communicator and at the block call). v of ``value_dim`` (None: ``dim``)."""
    import threading

    from xcp.comm import LocalGroup
    from xcp.ring import BlockCall

    gen = torch.Generator().manual_seed(0)
    total = prompt + sum(steps)
    q = torch.randn(1, total, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, total, 1, d, generator=gen).to(dtype) for d in (dim, value_dim or dim))
    mine = threading.local()
    exchange, forward = LocalGroup.exchange, BlockCall.forward

    def counting_exchange(self, sends, recvs, tag, backend, step=None):
        if tag == "combine":
            mine.sent += sum(t.numel() * t.element_size() for t, _ in sends)
        return exchange(self, sends, recvs, tag, backend, step)

    def counting_forward(self, *args):
        mine.calls += 1
        return forward(self, *args)

    def rank_fn(group):
        cache, rows, s = xcp.KVCache(group=group, balance=balance, combine=combine), [], prompt
        if prompt:
            cache.prefill(*(xcp.shard(x[:, :prompt], world, group.rank(), balance=balance) for x in (k, v)))
        for t in steps:
            cache.append(k[:, s : s + t], v[:, s : s + t])
            s += t
            mine.sent = mine.calls = 0
            cache.attention(q[:, s - t : s], window=window)
            rows.append((cache.local_len, mine.calls, mine.sent))
        return rows

    LocalGroup.exchange, BlockCall.forward = counting_exchange, counting_forward
    try:
        return xcp.LocalWorld(world).run(rank_fn)
    finally:
        LocalGroup.exchange, BlockCall.forward = exchange, forward


@pytest.mark.parametrize(
    ("world", "prompt", "balance", "window", "dtype", "qk_dim"),
    [
        (4, 16, "zigzag", None, "float32", 8),
        (3, 0, "contiguous", (2, 0), "float64", 8),
        (1, 8, "stripe", None, "bfloat16", 8),
        (4, 8, "stripe", None, "over heads", 8),
        (4, 16, "zigzag", None, "bfloat16", 12),  # q/k of 12, v of 8: the partials' out is v's, as is the combine
        (4, 8, "stripe", None, "over heads", 12),
    ],  # fmt: skip
)
def test_plan_decode_is_what_the_cache_holds_calls_and_sends(monkeypatch, capsys, world, prompt, balance, window,
                                                             dtype, qk_dim):  # fmt: skip
    import re

    from xcp.cli.common import DTYPES, human_bytes
    from xcp.inference import plan as cache_plan

    over_heads = dtype == "over heads"
    if over_heads:  # the chunk of 7 combines over heads: the lse, then a quarter of the weighted partial and of out
        monkeypatch.setattr(cache_plan, "HEADS_COMBINE_MIN_QUERIES", 2)
        dtype = "bfloat16"

    args = ["plan", "--world", str(world), "--decode", "3", "--chunk", "7", "--balance", balance, "--heads", "4",
            "--kv-heads", "1", "--head-dim", str(qk_dim), "--value-head-dim", "8", "--dtype", dtype]  # fmt: skip
    args += (["--seq", str(prompt)] if prompt else []) + (["--window", f"{window[0]},0"] if window else [])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"head_dim {qk_dim}/8," in text if qk_dim != 8 else "head_dim 8," in text
    counted = counted_decode(world, prompt, [1, 1, 1, 7], balance, window, 4, qk_dim, DTYPES[dtype],
                             "heads" if over_heads else "auto", 8)  # fmt: skip
    cell = r"(\d+(?:\.\d+)? \w+)"
    rows = re.findall(rf"^(?:decode \d+|chunk)\s+(\d+)\s+(\d+)\s+([\d ]+?)\s\s+([\d ]+?)\s\s+{cell}\s+{cell}$", text,
                      re.M)  # fmt: skip
    assert len(rows) == 4, text
    item = 8 if dtype == "float64" else 4
    for i, (t, seq, held, calls, sends, gathers) in enumerate(rows):
        assert int(seq) == prompt + [1, 2, 3, 10][i]
        assert [int(x) for x in held.split()] == [c[i][0] for c in counted]
        assert [int(x) for x in calls.split()] == [c[i][1] for c in counted]
        if over_heads and int(t) > 1:
            assert {c[i][2] for c in counted} == {3 * (7 * 4 * 4 + 2 * 7 * 8 * 2)}  # float32 lse; 1 head of D 8 twice
            assert gathers == human_bytes(4 * (7 * 4 * 4 + 2 * 7 * 8 * 2))
        elif dtype == "bfloat16":
            assert {c[i][2] for c in counted} == {(world - 1) * int(t) * 4 * 10 * 2}  # [out | lse bits], D + 2
            assert gathers == human_bytes(world * int(t) * 4 * 10 * 2 if world > 1 else 0)
        else:
            assert {c[i][2] for c in counted} == {(world - 1) * int(t) * 4 * 9 * item}  # P-1 partials [out | lse]
            assert gathers == human_bytes(world * int(t) * 4 * 9 * item if world > 1 else 0)
        assert sends == human_bytes(counted[0][i][2])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ulysses", "2"], "--decode: expected no --ulysses"),
        (["--documents", "8,8"], "--decode: expected no --documents"),
        (["--seq", "12"], "--seq"),
        (["--window", "2,3"], "--window: with a causal mask R must be 0 or none"),
        (["--chunk", "-1"], "--chunk: expected an integer >= 0; got -1"),
    ],
)
def test_plan_decode_bad_flags_name_the_flag(capsys, args, message):
    assert main(["plan", "--world", "4", "--decode", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xcp plan: error: ") and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backward"], "--decode: expected no --backward (a KV cache's attention is inference: no backward pass); "
         "got --backward"),
        (["--policy", "keep_all"], "--decode: expected no --policy (the ring's slot policy; a KV cache's attention "
         "runs no ring); got --policy keep_all"),
        (["--calls", "2"], "--decode: expected no --calls (the ring's calls per rank; a KV cache's attention runs no "
         "ring: its calls are the steps --decode and --chunk give); got --calls 2"),
        (["--no-causal"], "--decode: expected a causal mask (each token attends to the tokens before it); got "
         "--no-causal"),
        (["--window", "2,1"], "--window: with a causal mask R must be 0 or none"),
        (["--seq", "6"], "--seq: balance 'zigzag' over 4 ranks needs a positive multiple of 8; got 6"),
        (["--decode", "0", "--chunk", "0"], "--decode: expected a step to run"),
    ],
)  # fmt: skip
def test_sanitize_decode_refuses_what_it_does_not_run(capsys, args, message):
    _fails_with_usage_error(capsys, ["sanitize", "--world", "4", "--decode", "2", *args], message)


def test_sanitize_decode_honours_the_window(capsys, monkeypatch):
    """--window bands the cache's attention (decode steps on the device path of --capacity, the chunk on the
    host's), checked against float64 attention under the banded mask: caches that drop it fail. The ring's
    flags left at their defaults are accepted."""
    args = ["sanitize", "--world", "3", "--decode", "2", "--chunk", "3", "--capacity", "--window", "2,0",
            "--policy", "bounded", "--calls", "1"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "window=2,0" in text and "  window 2,0: query i sees keys i-2..i\n" in text
    assert "largest error against float64 SDPA with the banded mask: out" in text and "no finding" in text
    banded = xcp.KVCache.attention
    monkeypatch.setattr(xcp.KVCache, "attention", lambda self, q, window=None: banded(self, q))
    assert main(args) == 1
    assert "[numerics] out: error" in capsys.readouterr().out


# --- values of another head dim (--value-head-dim: multi-head latent attention, q/k 192 and v 128) ---


def test_tool_inputs_and_reference_take_the_value_head_dim():
    """q, k (and dq, dk) in --head-dim; v, dout, out and dv in --value-head-dim; None is --head-dim."""
    from xcp.cli.common import Problem, random_inputs, reference

    problem = Problem(heads=4, kv_heads=2, head_dim=12, dtype="float64", value_head_dim=8)
    q, k, v, dout = random_inputs(problem, 6, torch.device("cpu"))
    assert [tuple(x.shape) for x in (q, k, v, dout)] == [(1, 6, 4, 12), (1, 6, 2, 12), (1, 6, 2, 8), (1, 6, 4, 8)]
    out, dq, dk, dv = reference(q, k, v, dout, True)
    assert [x.shape for x in (out, dq, dk, dv)] == [dout.shape, q.shape, k.shape, v.shape]
    same = Problem(heads=4, kv_heads=2, head_dim=12, dtype="float64")
    assert same.value_dim == 12 and random_inputs(same, 6, torch.device("cpu"))[2].shape[-1] == 12


@pytest.mark.parametrize(
    "extra",
    [["--world", "1"], ["--world", "2", "--dtype", "float64"], ["--world", "4", "--balance", "stripe"],
     ["--world", "4", "--ulysses", "2"], ["--world", "3", "--decode", "2", "--chunk", "3"]],
    ids=["P1", "P2-float64", "P4-stripe", "ulysses2", "decode"],
)  # fmt: skip
def test_run_checks_values_of_another_head_dim(capsys, extra):
    from xcp.cli.run import TENSORS

    args = ["run", "--seq", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "12", "--value-head-dim", "8"]
    assert main([*args, *extra]) == 0
    text = capsys.readouterr().out
    assert "head_dim 12/8" in text and text.endswith("PASS\n"), text
    if "--decode" in extra:
        assert list(decode_rows(text)) == ["prefill", "decode 1", "decode 2", "chunk"]
    else:
        assert "values of another head dim: q, k, dq, dk of 12; v, out, dout, dv of 8" in text
        rows = {line.split()[0]: line.split()[-1] for line in text.splitlines() if line.split()[0] in TENSORS}
        assert rows == dict.fromkeys(TENSORS, "ok")


def test_run_value_head_dim_equal_to_head_dim_is_the_plain_run(capsys):
    assert main(["run", *SMALL, "--value-head-dim", "4"]) == 0
    text = capsys.readouterr().out
    assert "head_dim 4," in text and "another head dim" not in text and "PASS" in text


@pytest.mark.parametrize("tool", ["run", "bench"])
@pytest.mark.parametrize("value", ["0", "-2", "x", "1.5"])
def test_bad_value_head_dim_is_a_usage_error(capsys, tool, value):
    with pytest.raises(SystemExit) as exit_:
        main([tool, f"--value-head-dim={value}"])
    assert exit_.value.code == 2
    assert f"--value-head-dim: expected an integer >= 1; got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("world", "ulysses", "balance", "lengths", "dtype"),
    [
        (3, 1, "document_zigzag", (5, 1, 13), "float64"),  # shards of 7, 6, 6 tokens: each travels as 7
        (4, 1, "zigzag", None, "bfloat16"),
        (4, 2, "zigzag", None, "float32"),
    ],
)
def test_plan_value_head_dim_bytes_are_the_formula_and_what_a_run_sends(capsys, world, ulysses, balance, lengths,
                                                                         dtype):  # fmt: skip
    """xcp plan --value-head-dim: K, q, dq, dk counted in --head-dim; V, out, dout, dv in --value-head-dim (the
    ring's K/V shards and dK/dV messages, the hybrid's all-to-alls): the formula written out here, and what
    each rank of a LocalWorld run of xcp.attention sends."""
    from xcp.cli.packing import boundaries

    d, dv, heads, kv_heads = 12, 8, 4, 2
    seq, cu = (sum(lengths), boundaries(lengths)) if lengths else (32, None)
    args = ["plan", "--world", str(world), "--ulysses", str(ulysses), "--causal", "--balance", balance, "--heads",
            str(heads), "--kv-heads", str(kv_heads), "--head-dim", str(d), "--value-head-dim", str(dv), "--dtype",
            dtype, *(["--documents", ",".join(map(str, lengths))] if lengths else ["--seq", str(seq)])]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "D/Dv 12/8" in text and max(len(line) for line in text.splitlines()) <= 100
    item, acc = torch.empty((), dtype=getattr(torch, dtype)).element_size(), 8 if dtype == "float64" else 4
    counted = counted_hybrid_run(world, ulysses, seq, heads, kv_heads, d, getattr(torch, dtype), True, balance, None,
                                 dv, cu)  # fmt: skip
    if ulysses == 1:
        n = -(-seq // world)  # the longest shard's tokens
        shard, message = (n * kv_heads * (d + dv) * x for x in (item, acc))
        cost = cost_rows(text)
        assert cost["forward K/V"][0] == cost["backward K/V"][0] == (world - 1) * shard
        assert cost["backward dK/dV"][0] == world * message
        want = {("forward", "kv"): (world - 1) * shard, ("backward", "kv"): (world - 1) * shard,
                ("backward", "dkv"): world * message}  # fmt: skip
        for per_rank in counted:
            assert {key: sum(x[2] for x in per_rank if x[:2] == key) for key in want} == want
            assert {x[:2] for x in per_rank} == set(want)
        return
    n, r = seq // world, world // ulysses
    q_d, q_v, kv_d, kv_v = ((ulysses - 1) * n * h * x * item // ulysses for h in (heads, kv_heads) for x in (d, dv))
    shard, message = ((seq // r) * (kv_heads // ulysses) * (d + dv) * x for x in (item, acc))
    rows, totals = hybrid_rows(text)
    want = {"q": q_d, "k": kv_d, "v": kv_v, "out": q_v, "dout": q_v, "dq": q_d, "dk": kv_d, "dv": kv_v,
            "K/V shard": shard, "dK/dV": message}  # fmt: skip
    assert {row[2]: row[3] for row in rows} == want
    for per_rank in counted:  # the all-to-alls, in order: q, k, v in; out back; dout in; dq, dk, dv back
        assert [x[2] for x in per_rank if x[1] == "a2a"] == [q_d + kv_d + kv_v, q_v, q_v, q_d + kv_d + kv_v]
        assert sum(x[2] for x in per_rank if x[0] == "forward") == totals["forward total"][0]
        assert sum(x[2] for x in per_rank if x[0] == "backward") == totals["backward total"][0]


# --- packed documents in xcp run, and the balance that places each of them (document_zigzag) ---


@pytest.mark.parametrize(
    "extra",
    [["--world", "3", "--balance", "document_zigzag", "--head-dim", "12", "--value-head-dim", "8"],
     ["--world", "4", "--balance", "stripe", "--ulysses", "2", "--head-dim", "8"]],
    ids=["document_zigzag", "stripe-ulysses"],
)  # fmt: skip
def test_run_documents_checks_the_ring_over_packed_documents(capsys, monkeypatch, extra):
    """xcp run --documents: the shards placed (by each document under document_zigzag: 14, 13, 13 tokens),
    xcp.attention given the boundaries, every tensor checked against float64 attention over each document
    alone; the ring honours them: against the whole sequence's attention the run fails."""
    import re

    from xcp.cli import run

    args = ["run", "--documents", "5,1,13,21", "--heads", "4", "--kv-heads", "2", "--dtype", "float64", *extra]
    assert main(args) == 0
    text = capsys.readouterr().out
    balance = extra[extra.index("--balance") + 1]
    assert "seq 40," in text and f"balance {balance}," in text and text.endswith("PASS\n"), text
    assert "documents: 4 packed, lengths 5,1,13,21 (each attends within itself)" in text
    for name in run.TENSORS:
        assert float(re.search(rf"^{name}\s+\S+\s+(\S+)\s+\S+\s+ok$", text, re.M).group(1)) <= 1e-11
    if balance == "document_zigzag":
        whole = run.reference
        monkeypatch.setattr(run, "reference", lambda q, k, v, dout, causal, cu: whole(q, k, v, dout, causal))
        assert main(args) == 1 and "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tool", "args", "message"),
    [
        ("run", ["--balance", "document_zigzag"], "--balance: document_zigzag places each packed document: expected "
         "--documents too; got --balance document_zigzag without --documents"),
        ("plan", ["--balance", "document_zigzag", "--seq", "16"], "--balance: document_zigzag places each packed "
         "document: expected --documents too"),
        ("plan", ["--balance", "document_zigzag", "--decode", "2"], "--balance: document_zigzag places each packed "
         "document: expected --documents too"),
        ("run", ["--balance", "document_zigzag", "--documents", "8,9", "--ulysses", "2"], "--documents: expected a "
         "multiple of 4 ranks with --ulysses 2 (each of the 2 ring shards is cut into 2 pieces; document_zigzag "
         "splits any length only with --ulysses 1); got 17"),
        ("plan", ["--balance", "document_zigzag", "--documents", "8,9", "--ulysses", "2"], "--documents: expected a "
         "multiple of 4 ranks with --ulysses 2"),
        ("sanitize", ["--balance", "document_zigzag", "--documents", "3", "--seq", "9", "--ulysses", "2"], "--seq: "
         "expected a multiple of 4 ranks with --ulysses 2"),
        ("sanitize", ["--balance", "document_zigzag"], "--balance: document_zigzag places each packed document: "
         "expected --documents too"),
        ("plan", ["--balance", "auto", "--documents", "8,9", "--ulysses", "2"], "--documents: expected a multiple "
         "of 4 ranks with --ulysses 2 (each of the 2 ring shards is cut into 2 pieces; document_zigzag splits any "
         "length only with --ulysses 1); got 17"),
        ("plan", ["--balance", "auto", "--documents", "1,2"], "--documents: expected lengths summing to at least 4 "
         "tokens (balance 'document_zigzag' over 4 ranks places one on each at least); got a sum of 3"),
        ("run", ["--balance", "document_zigzag", "--documents", "1,2"], "--documents: expected lengths summing to at "
         "least 4 tokens"),
        ("run", ["--documents", "8,8", "--decode", "2"], "--decode: expected no --documents"),
        ("run", ["--documents", "8,8", "--batch", "2"], "--batch: expected 1 with --documents (the packed layout); "
         "got 2"),
        ("run", ["--documents", "8,9"], "--documents: expected lengths summing to a multiple of 8 (balance 'zigzag' "
         "over 4 ranks needs it); got a sum of 17"),
    ],
)  # fmt: skip
def test_documents_and_document_zigzag_bad_flags_name_the_flag(capsys, tool, args, message):
    assert main([tool, "--world", "4", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xcp {tool}: error: ") and message in err, err


def test_plan_document_zigzag_prints_its_figures(capsys):
    """Uneven shards (7, 6, 6 tokens): the table, the work per rank, the ring's cost with every K/V shard
    travelling as long as the longest, and the balances weighed with documents, document_zigzag among them."""
    import re

    assert main(["plan", "--world", "3", "--causal", "--documents", "5,1,13", "--balance", "document_zigzag",
                 "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "ring plan: world 3, causal attention, balance document_zigzag, 3 packed documents"
    assert lines[1] == "documents: S = 19 tokens (6 or 7 per rank), lengths 5,1,13"
    assert "a K/V shard is 2·(⌈S/P⌉)·Hkv·D·itemsize = 2·7·2·8·4 (float32) = 896 B" in text
    assert "the shards differ by a token: each travels as long as the longest, ⌈S/P⌉ = 7 tokens" in text
    assert cost_rows(text)["forward K/V"] == (2 * 896, 2 * 896)
    assert re.search(r"^  document_zigzag busiest \S+ even, .*<- recommended, this plan$", text, re.M)
    assert re.search(r"^  zigzag +cannot split S = 19 \(needs a multiple of 6\)$", text, re.M)
    assert max(len(line) for line in lines) <= 100


def test_plan_auto_with_documents_takes_any_length_document_zigzag_splits(capsys):
    """--balance auto with --documents weighs document_zigzag too, which splits any length of at least P
    tokens: S = 19 over 3 ranks (no multiple of 3) gets its plan rather than a demand for a multiple of P."""
    import re

    assert main(["plan", "--world", "3", "--causal", "--documents", "5,1,13", "--balance", "auto"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "--balance auto: xcp.choose_balance recommends document_zigzag"
    assert lines[1] == "ring plan: world 3, causal attention, balance document_zigzag, 3 packed documents"
    assert re.search(r"^  document_zigzag busiest \S+ even, .*<- recommended, this plan$", text, re.M)


def test_sanitize_value_head_dim_runs_the_ring_and_the_cache(capsys):
    assert main(["sanitize", "--world", "3", "--backward", "--head-dim", "12", "--value-head-dim", "8"]) == 0
    text = capsys.readouterr().out
    assert "head_dim=12/8" in text and "no finding" in text
    assert main(["sanitize", "--world", "3", "--decode", "2", "--chunk", "3", "--head-dim", "8",
                 "--value-head-dim", "12"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "head_dim=8/12" in text and "no finding" in text


@pytest.mark.parametrize(("balance", "ulysses", "world"), [("document_zigzag", 1, 3), ("stripe", 2, 4)])
def test_run_documents_on_the_path_of_virtual_gpu_ranks(balance, ulysses, world):
    """On a GPU xcp run drives each virtual rank through ring_forward/ring_backward (or the hybrid's) with the
    documents in their configurations: that path, run here on the CPU, equals one softmax over the whole
    sequence under the document mask (the tests' own reference), and so does the tool's per-document one."""
    from helpers import independent_masked_reference

    from xcp.cli.common import random_inputs as tool_inputs
    from xcp.cli.common import reference as tool_reference
    from xcp.cli.run import RunConfig, rank_step

    cu = (0, 5, 6, 19, 40)
    cfg = RunConfig(world=world, seq=40, heads=4, kv_heads=2, head_dim=12, value_head_dim=8, dtype="float64",
                    device="cpu", ulysses=ulysses, balance=balance, documents=cu)  # fmt: skip
    full = tool_inputs(cfg, cfg.seq, torch.device("cpu"))
    results = xcp.LocalWorld(world).run(rank_step, cfg, xcp.get_backend("cpu"), full, True)
    want = independent_masked_reference(*full, cu, True)
    for i, tool in enumerate(tool_reference(*full, True, cu)):
        torch.testing.assert_close(xcp.unshard([r[i] for r in results], **cfg.place()), want[i], atol=1e-10, rtol=0)
        torch.testing.assert_close(tool, want[i], atol=1e-10, rtol=0)
