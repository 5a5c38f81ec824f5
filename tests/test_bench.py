"""The bench's arithmetic and argument handling, with tiny sizes on the CPU (no timing is asserted)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys

import pytest
from helpers import installed

import xcp
from xcp.cli import main
from xcp.cli.bench import BenchConfig, format_report, ratio, run_bench
from xcp.cli.common import attention_flops, median


def tiny(**kw) -> BenchConfig:
    base = dict(
        seqs=[32],
        worlds=[2],
        causal=[True],
        heads=4,
        kv_heads=2,
        head_dim=8,
        dtype="float32",
        device="cpu",
        warmup=0,
        reps=1,
        memory_seq=64,
        memory_worlds=[2, 4],
        graph=False,
    )
    base.update(kw)
    return BenchConfig(**base)


def test_median_and_ratio():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0]) == 2.5
    assert ratio(1.1, 1.0) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="reference_seconds: expected a positive time; got 0"):
        ratio(1.0, 0.0)
    with pytest.raises(ValueError, match="values"):
        median([])


def test_flops_count():
    # 4 * B * S^2 * H * D forward; causal halves it; forward+backward is 3.5 times the forward
    assert attention_flops(1, 1024, 32, 128, False, False) == 4 * 1024**2 * 32 * 128
    assert attention_flops(2, 1024, 32, 128, True, True) == pytest.approx(2 * 4 * 1024**2 * 32 * 128 / 2 * 3.5)
    assert attention_flops(2, 1024, 32, 128, True, True, 128) == attention_flops(2, 1024, 32, 128, True, True)
    # v of another head dim: q·kᵀ in D, p·v in Dv; the backward recomputes q·kᵀ, dq and dk in D, dp and dv in Dv
    pairs = 1024**2 / 2
    assert attention_flops(1, 1024, 32, 192, True, False, 128) == 2 * pairs * 32 * (192 + 128)
    assert attention_flops(1, 1024, 32, 192, True, True, 128) == 2 * pairs * 32 * (4 * 192 + 3 * 128)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("seqs", [], "seqs: expected a non-empty list"),
        ("worlds", [0], "worlds: expected a non-empty list of integers >= 1"),
        ("kv_heads", 3, "kv_heads: expected a divisor of heads=4; got 3"),
        ("dtype", "int8", "dtype: expected one of"),
        ("seqs", [30], "seqs: 30 is not a multiple of 2 x world 2"),
        ("warmup", -1, "warmup: expected an integer >= 0"),
        ("value_head_dim", 0, "value_head_dim: expected a positive integer"),
    ],
)
def test_config_errors(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny(**{field: value}).validate()


def test_run_bench_report_is_consistent():
    report = run_bench(tiny(causal=[False, True]), progress=False)
    rows = report["timing"]
    assert [(r["seq"], r["world"], r["causal"]) for r in rows] == [(32, 2, False), (32, 2, True)]
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            assert r[f"{mode}_check_ok"], r[f"{mode}_errors"]
            assert r[f"{mode}_ratio"] == pytest.approx(r[f"{mode}_ring_s"] / r[f"{mode}_ref_s"])
        assert set(r["fwd_bwd_errors"]) == {"out", "dq", "dk", "dv"}
    mem = {(m["world"], m["policy"]): m for m in report["memory"]}
    # the bound: at most 4 received shards (2 KV + 2 dKV) per rank; keep_all grows with P
    assert mem[(4, "bounded")]["peak_kv_shards"] <= 4
    assert mem[(4, "keep_all")]["peak_kv_shards"] > mem[(4, "bounded")]["peak_kv_shards"]
    assert mem[(4, "keep_all")]["peak_ring_bytes_per_rank"] > mem[(4, "bounded")]["peak_ring_bytes_per_rank"]
    text = format_report(report)
    assert "keep_all" in text and "causal" in text
    json.dumps(report)  # every figure is JSON-ready


def test_cli_bench_json(tmp_path, capsys):
    path = tmp_path / "b.json"
    code = main(
        ["bench", "--device", "cpu", "--seqs", "16", "--worlds", "2", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "4", "--dtype", "float64", "--reps", "1", "--warmup", "0", "--memory-seq", "16",
         "--memory-worlds", "2", "--quiet", "--mask", "full", "--json", str(path)]
    )  # fmt: skip
    assert code == 0
    data = json.loads(path.read_text())
    assert data["meta"]["config"]["dtype"] == "float64"
    assert math.isfinite(data["timing"][0]["fwd_bwd_ratio"])


def test_cli_bench_rejects_bad_lists(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--seqs", "12,x"])
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_distributed_needs_torchrun(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench", "--distributed", "--device", "cpu"]) == 2
    assert "expected to run under torchrun" in capsys.readouterr().err


def test_distributed_bench_gloo_two_processes(tmp_path):
    """The torchrun path of issue 6 on CPU processes with gloo: correctness, throughput and memory rows."""
    out = tmp_path / "d.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "xcp.cli",
           "bench", "--distributed", "--device", "cpu", "--seqs", "32", "--check-seq", "32", "--reference-seq", "32",
           "--memory-seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32",
           "--reps", "1", "--warmup", "0", "--json", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["world"] == 2 and data["dist_backend"] == "gloo"
    assert data["check"]["ok"] and max(data["check"]["errors"].values()) < 1e-4
    policies = {m["policy"]: m for m in data["memory"]}
    assert policies["bounded"]["peak_kv_shards"] <= 4
    assert policies["keep_all"]["peak_ring_bytes"] >= policies["bounded"]["peak_ring_bytes"]


# --- sizes default to the device; what does not fit is refused up front (issue 10, item 9) ---


def test_cpu_bench_without_sizes_uses_the_small_cpu_defaults(capsys, monkeypatch):
    """No size flags on the CPU: the small CPU grid (not the H200 grid, terabytes of scores on the CPU)."""
    from xcp.cli import common

    monkeypatch.setattr(common, "available_bytes", lambda backend, device: 1)  # refuse, to see the sizes
    assert main(["bench", "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "H=8/2 D=64 float32" in err and "131072" not in err and "262144" not in err


def test_bench_refuses_what_does_not_fit_in_memory(capsys):
    assert main(["bench", "--device", "cpu", "--seqs", "1048576", "--worlds", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "xcp bench: error: this configuration needs about" in err and "TiB" in err
    assert "S=1048576" in err and "available RAM is" in err


def test_size_defaults_follow_the_device_type():
    import argparse

    from xcp.cli.bench import SIZE_FLAGS
    from xcp.cli.common import CPU_SIZES, DEVICE_SIZES, apply_size_defaults

    class Device:
        device_type = "cuda"

    class Host:
        device_type = "cpu"

    args = argparse.Namespace(**{**dict.fromkeys(SIZE_FLAGS), "heads": 4})
    note = apply_size_defaults(args, Device(), SIZE_FLAGS)
    assert args.seqs == DEVICE_SIZES["seqs"] and args.heads == 4 and ", heads " not in note and "kv-heads 8" in note
    args = argparse.Namespace(**dict.fromkeys(SIZE_FLAGS))
    note = apply_size_defaults(args, Host(), SIZE_FLAGS)
    assert args.seqs == CPU_SIZES["seqs"] and args.memory_seq == CPU_SIZES["memory_seq"]
    assert note.startswith("small CPU defaults (cpu)")
    given = argparse.Namespace(**{n: 1 for n in SIZE_FLAGS})
    assert apply_size_defaults(given, Host(), SIZE_FLAGS) is None


def test_bench_without_device_runs_on_a_usable_backend(capsys, monkeypatch):
    """No --device: XCP_DEVICE where set, else the first usable backend on a device, else the CPU, never an
    exit 2 on a machine without CUDA; the header says which was taken and why."""
    import argparse

    from xcp.cli import common
    from xcp.plugins import BackendRow

    def row(name, device_type, available):
        return BackendRow(name, device_type, "gloo", "none", "math", available, "" if available else "no", name)

    monkeypatch.delenv("XCP_DEVICE", raising=False)
    table = [row("cpu", "cpu", True), row("cuda", "cuda", False), row("acc", "acc", True), row("acc2", "acc", True)]
    monkeypatch.setattr(common, "backend_table", lambda: table)
    args = argparse.Namespace(device=None)
    assert common.default_device(args) == "device acc (the first usable backend on a device; --device picks another)"
    assert args.device == "acc"
    monkeypatch.setenv("XCP_DEVICE", "cpu")
    args.device = None
    assert common.default_device(args) == "device cpu (XCP_DEVICE)" and args.device == "cpu"
    args.device = "cuda:1"
    assert common.default_device(args) is None and args.device == "cuda:1"  # given: kept
    monkeypatch.delenv("XCP_DEVICE")
    no_device = [r for r in table if r.device_type == "cpu" or not r.available]
    monkeypatch.setattr(common, "backend_table", lambda: no_device)
    flags = "--seqs 16 --worlds 2 --heads 2 --kv-heads 1 --head-dim 4 --reps 1 --warmup 0 --memory-seq 16"
    assert main(["bench", *flags.split(), "--memory-worlds", "2", "--quiet", "--mask", "full", "--no-graph"]) == 0
    out = capsys.readouterr().out
    assert "sizes: device cpu (no backend on a device is usable here; --device picks another), small CPU" in out


def test_cli_bench_header_says_which_defaults(tmp_path, capsys):
    path = tmp_path / "b.json"
    code = main(
        ["bench", "--device", "cpu", "--seqs", "16", "--worlds", "2", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "4", "--reps", "1", "--warmup", "0", "--memory-seq", "16", "--memory-worlds", "2",
         "--quiet", "--mask", "full", "--no-graph", "--json", str(path)]
    )  # fmt: skip
    assert code == 0
    assert "sizes: small CPU defaults (cpu): dtype float32" in capsys.readouterr().out
    assert json.loads(path.read_text())["meta"]["config"]["dtype"] == "float32"


def test_bench_accepts_a_plugin_backend_whose_device_type_is_cpu(capsys, monkeypatch):
    """--device names a backend (the tensors live on its device_type), and its sizes are the CPU's."""
    from xcp.backends.cpu import CPUBackend
    from xcp.hookspecs import hookimpl
    from xcp.plugins import register_plugin, unregister_plugin

    class Renamed(CPUBackend):
        name = "bench-test-cpu"

    class Plugin:
        @hookimpl
        def xcp_register_backends(self, register):
            register(Renamed())

    plugin = Plugin()
    register_plugin(plugin, "bench-test")
    try:
        code = main(
            ["bench", "--device", "bench-test-cpu", "--seqs", "16", "--worlds", "2", "--heads", "2",
             "--kv-heads", "1", "--head-dim", "4", "--reps", "1", "--warmup", "0", "--memory-seq", "16",
             "--memory-worlds", "2", "--quiet", "--mask", "full", "--no-graph"]
        )  # fmt: skip
    finally:
        unregister_plugin(plugin)
    assert code == 0
    text = capsys.readouterr().out
    assert "backend bench-test-cpu" in text and "small CPU defaults" in text


# --- packed documents (issue 11): the ring over documents against one whole-sequence varlen call ---

DOC_FLAGS = ["bench", "--device", "cpu", "--heads", "2", "--kv-heads", "1", "--head-dim", "4", "--dtype", "float64",
             "--reps", "1", "--warmup", "0", "--quiet"]  # fmt: skip


def test_cli_bench_documents_prints_ratios_work_shares_and_the_dense_ratio(tmp_path, capsys):
    lengths = [3, 9, 1, 1, 18]
    path = tmp_path / "docs.json"
    code = main([*DOC_FLAGS, "--documents", ",".join(map(str, lengths)), "--worlds", "2,4", "--mask", "causal",
                 "--compare-dense", "--json", str(path)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    assert "packed documents (5 documents, lengths 3,9,1,1,18): ring of P virtual ranks vs one whole-sequence" in text
    assert "work max/mean" in text and "dense f+b" in text and "share of the work per rank" in text
    data = json.loads(path.read_text())
    rows = data["documents"]
    assert [(r["seq"], r["world"], r["causal"], r["documents"]) for r in rows] == [(32, 2, True, 5), (32, 4, True, 5)]
    assert [(r["seq"], r["world"], r["causal"]) for r in data["timing"]] == [(32, 2, True), (32, 4, True)]
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            assert r[f"{mode}_check_ok"] and max(r[f"{mode}_errors"].values()) < 1e-12, r[f"{mode}_errors"]
            assert math.isfinite(r[f"{mode}_ratio"]) and r[f"{mode}_ratio"] > 0
        assert set(r["fwd_bwd_errors"]) == {"out", "dq", "dk", "dv"}
        assert sum(r["work_pairs"]) == sum(n * (n + 1) // 2 for n in lengths)  # every allowed pair, once
        assert sum(r["work_share"]) == pytest.approx(1.0)
        assert r["work_max_over_mean"] == pytest.approx(max(r["work_pairs"]) * r["world"] / sum(r["work_pairs"]))
        line = next(x for x in text.splitlines() if x.startswith(f"  S=32 P={r['world']} causal: "))
        assert line.split(": ", 1)[1].startswith(" ".join(f"r{i} {s:.3f}" for i, s in enumerate(r["work_share"])))
        assert f"max/mean {r['work_max_over_mean']:.3f}" in line
    table = [x.split() for x in text.splitlines() if x.strip().startswith("32 ")]
    assert [t[:4] for t in table] == [["32", "2", "causal", "5"], ["32", "4", "causal", "5"]]
    dense_ratio = {r["world"]: r["fwd_bwd_ratio"] for r in data["timing"]}
    assert [t[-4] for t in table] == [f"{dense_ratio[2]:.3f}", f"{dense_ratio[4]:.3f}"]  # the dense f+b column


def test_bench_documents_with_the_per_document_balance(tmp_path, capsys):
    """balance document_zigzag places each document over the ranks: checked against the varlen call, and its
    busiest rank does at most a few pairs more than the mean (zigzag's does far more on these lengths)."""
    path = tmp_path / "docs.json"
    flags = [*DOC_FLAGS, "--documents", "3,40,1,2,18", "--worlds", "4", "--mask", "causal"]
    assert main([*flags, "--balance", "document_zigzag", "--json", str(path)]) == 0, capsys.readouterr().out
    (row,) = json.loads(path.read_text())["documents"]
    assert row["balance"] == "document_zigzag" and row["fwd_bwd_check_ok"]
    assert row["work_max_over_mean"] < 1.05
    assert main(["bench", "--device", "cpu", "--quiet", "--balance", "document_zigzag"]) == 2
    assert "--balance: document_zigzag places each packed document: expected --documents" in capsys.readouterr().err


def test_run_bench_longtail_documents_fill_each_length():
    report = run_bench(tiny(documents="longtail:2:8:5", seqs=[32, 64], worlds=[4], causal=[False, True]),
                       progress=False)  # fmt: skip
    rows = report["documents"]
    assert [(r["seq"], r["causal"]) for r in rows] == [(32, False), (32, True), (64, False), (64, True)]
    for r in rows:
        assert r["fwd_check_ok"] and r["fwd_bwd_check_ok"], r
        assert 2 <= r["longest"] <= 8 and r["shortest"] >= 1 and r["documents"] >= r["seq"] // 8
    assert report["timing"] == [] and report["memory"] == [] and report["graph"] is None
    assert "long-tailed (log-uniform) lengths in [2, 8], seed 5" in format_report(report)


def test_bench_documents_check_is_against_the_document_mask(monkeypatch, capsys):
    """The yardstick is the varlen call over the documents: given the dense whole-sequence kernel instead,
    the ring (which honours the documents) fails its check and the command exits 1."""
    from xcp.cli.bench import documents
    from xcp.cli.common import whole_kernel

    monkeypatch.setattr(documents, "whole_varlen", lambda be, full, cu, causal, b: whole_kernel(be, full, causal, b))
    assert main([*DOC_FLAGS, "--documents", "5,11", "--worlds", "2", "--mask", "causal"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--documents", "3,4", "--worlds", "4"], "--documents: expected lengths summing to a multiple of 8 "
         "(balance 'zigzag' over 4 ranks needs it); got a sum of 7 (nearest: 8)"),
        (["--documents", "3,5", "--seqs", "16"],
         "--documents: expected lengths summing to --seqs 16; got 2 lengths summing to 8"),
        (["--documents", "3,5", "--seqs", "8,16"],
         "--seqs: expected one length, the sum of the --documents lengths (8), or none; got 8,16"),
        (["--documents", "longtail:4:8", "--seqs", "30", "--worlds", "2"],
         "--seqs: balance 'zigzag' over 2 ranks needs a positive multiple of 4; got 30"),
        (["--documents", "8,8", "--batch", "2", "--worlds", "2"],
         "--batch: expected 1 with --documents (the packed layout); got 2"),
        (["--compare-dense"], "--compare-dense: expected together with --documents"),
        (["--documents", "8,8", "--distributed"], "--documents: not measured with --distributed yet; got '8,8'"),
    ],
)  # fmt: skip
def test_bench_bad_documents_name_the_flag_the_expected_and_the_actual(capsys, args, message):
    assert main(["bench", "--device", "cpu", "--quiet", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"xcp bench: error: {message}")


def test_bench_unparsable_documents_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--documents", "longtail:512"])
    err = capsys.readouterr().err
    assert "--documents: expected longtail:MIN:MAX[:SEED] with integers 1 <= MIN <= MAX" in err
    assert "got 'longtail:512'" in err


# --- sliding windows (issue 12): the ring under a window against one whole-sequence windowed call ---

WINDOW_FLAGS = [*DOC_FLAGS, "--seqs", "64", "--worlds", "4"]


def test_cli_bench_window_prints_ratio_steps_and_bytes_beside_the_dense_rings(tmp_path, capsys):
    path = tmp_path / "w.json"
    code = main([*WINDOW_FLAGS, "--window", "8,0", "--balance", "contiguous", "--compare-dense", "--json", str(path)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "sliding window 8,0 (query i sees keys i-8..i):" in text
    data = json.loads(path.read_text())
    (row,) = data["documents"]
    assert [row[k] for k in ("seq", "world", "causal", "balance", "window")] == [64, 4, True, "contiguous", "8,0"]
    for mode in ("fwd", "fwd_bwd"):
        assert row[f"{mode}_check_ok"] and max(row[f"{mode}_errors"].values()) < 1e-12, row[f"{mode}_errors"]
        assert math.isfinite(row[f"{mode}_ratio"]) and row[f"{mode}_ratio"] > 0
    # a window of 8 < S/P = 16 under contiguous: 2 of 4 steps; every rank sent what the formula says, measured
    shard = 2 * 16 * 1 * 4 * 8  # 2·(S/P)·Hkv·D·itemsize, float64
    assert row["ring_steps"] == 2 and row["sent_ok"]
    assert row["ring_sent_formula"]["fwd"] == shard and row["ring_sent_formula"]["fwd_bwd"] == shard + shard + 2 * shard
    assert row["fwd_sent_bytes"] == [{"kv": shard}] * 4
    assert row["fwd_bwd_sent_bytes"] == [{"kv": 2 * shard, "dkv": 2 * shard}] * 4
    assert row["dense_sent_formula"] == {"steps": 4, "fwd": 3 * shard, "fwd_bwd": 6 * shard + 4 * shard,
                                         "kv_shard": shard, "dkv_message": shard}  # fmt: skip
    (dense,) = data["timing"]  # --compare-dense: the dense ring measured beside, with all P steps
    assert dense["fwd_bwd_check_ok"] and dense["fwd_bwd_sent_bytes"] == [{"kv": 6 * shard, "dkv": 4 * shard}] * 4
    line = next(x.split() for x in text.splitlines() if x.strip().startswith("64 "))
    assert line[:4] == ["64", "4", "causal", "contiguous"] and line[13] == "2/4"
    assert line[11] == f"{row['fwd_bwd_ratio']:.3f}" and line[15] == f"{dense['fwd_bwd_ratio']:.3f}"
    assert "  S=64 P=4 causal contiguous: 2 of 4 steps, fwd 1.0 KiB, f+b 4.0 KiB (as measured)" in text
    assert "dense ring: 4 of 4 steps, fwd 3.0 KiB, f+b 10.0 KiB" in text


def test_bench_window_with_documents_and_balance_auto(capsys, tmp_path):
    path = tmp_path / "wd.json"
    code = main([*DOC_FLAGS, "--worlds", "4", "--window", "3,none", "--documents", "20,1,30,13", "--balance", "auto",
                 "--dtype", "float32", "--json", str(path)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    (row,) = json.loads(path.read_text())["documents"]
    assert row["causal"] and row["window"] == "3,0" and row["documents"] == 4  # R none with a causal mask is 0
    assert row["balance"] == xcp.choose_balance(4, causal=True, window=(3, 0), cu_seqlens=[0, 20, 21, 51, 64])
    assert row["fwd_bwd_check_ok"] and row["sent_ok"]
    assert "over packed documents (4 documents, lengths 20,1,30,13)" in text


def test_bench_window_check_is_against_the_windowed_call(monkeypatch, capsys):
    """The yardstick is the windowed call: given the call without the window instead, the ring (which
    honours the window) fails its check and the command exits 1."""
    from xcp.cli.bench import documents
    from xcp.cli.common import whole_varlen

    def unwindowed(be, full, cu, causal, w, b):
        return whole_varlen(be, full, cu, causal, b)

    monkeypatch.setattr(documents, "whole_window", unwindowed)
    assert main([*WINDOW_FLAGS, "--window", "5,0"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bench_window_bytes_are_measured_not_assumed(monkeypatch, capsys):
    """Were the formula wrong (here: one dK/dV message fewer), the measured bytes would disagree."""
    from xcp.traffic import RingTraffic

    monkeypatch.setattr(RingTraffic, "backward_dkv", property(lambda t: (t.steps - 1) * t.dkv_message))
    assert main([*WINDOW_FLAGS, "--window", "5,0", "--balance", "contiguous"]) == 1
    assert "MEASURED OTHERWISE" in capsys.readouterr().out


# --- host time per ring step, and the world of one against SDPA (issue 14) ---


def test_run_bench_host_reports_steps_targets_and_the_world_of_one():
    cfg = tiny(host=True, world_of_one=True, worlds=[2, 3], causal=[False, True], seqs=[16, 32], host_tokens=4)
    report = run_bench(cfg, progress=False)
    assert report["timing"] == [] and report["memory"] == []  # not the dense grid
    rows = report["host"]
    assert [(r["world"], r["causal"]) for r in rows] == [(2, False), (3, False), (2, True), (3, True)]
    for r in rows:
        # the check ran: every rank made one kernel call per step in every pass, none computed while timed
        assert r["calls_ok"] and r["steps"] == r["world"]
        assert r["kernel_calls_per_pass"] == {"fwd": [r["world"]], "bwd": [r["world"]]}
        assert r["kernels_computed_while_timed"] == 0 and r["kernels_computed_once"] >= 2
        assert r["reps"] >= 5 and r["calls_per_rep"] >= 1 and r["tokens_per_rank"] == 4
        assert (r["fwd_target_us"], r["bwd_target_us"]) == (50.0, 100.0)
        for key in ("step_us", "step_wall_us", "step_alone_us", "step_alone_cpu_us", "call_us"):
            for kind in ("fwd", "bwd"):
                assert math.isfinite(r[f"{kind}_{key}"]) and r[f"{kind}_{key}"] > 0, (kind, key)
    w1 = report["world_of_one"]
    assert [(r["seq"], r["causal"]) for r in w1] == [(16, False), (32, False), (16, True), (32, True)]
    for r in w1:
        assert r["fwd_check_ok"] and r["fwd_bwd_check_ok"]
        assert set(r["fwd_errors"]) == {"out"} and set(r["fwd_bwd_errors"]) == {"out", "dq", "dk", "dv"}
        assert max(r["fwd_bwd_errors"].values()) <= r["tolerance"] == 1e-4  # float32's bound
        assert r["reps"] >= 5
        for mode in ("fwd", "fwd_bwd"):
            assert r[f"{mode}_ratio"] == pytest.approx(r[f"{mode}_xcp_s"] / r[f"{mode}_sdpa_s"])
    text = format_report(report)
    assert "µs per step, mean over ranks" in text and "(≤ 50: " in text and "(≤ 100: " in text
    assert "alone µs/step" in text and "ok (3 calls/pass)" in text
    assert "world of one" in text and "SDPA" in text and "FAIL" not in text
    json.dumps(report)


def test_cli_bench_host_json_has_both_figures(tmp_path, capsys):
    path = tmp_path / "h.json"
    code = main(
        ["bench", "--host", "--device", "cpu", "--seqs", "16", "--worlds", "2", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "8", "--dtype", "float64", "--warmup", "0", "--reps", "1", "--host-tokens", "4",
         "--mask", "causal", "--quiet", "--json", str(path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "targets: forward ≤ 50 µs, backward ≤ 100 µs" in out
    assert "median of 5 repetitions" in out  # at least 5, whatever --reps
    data = json.loads(path.read_text())
    assert data["meta"]["config"]["host"] and data["meta"]["config"]["world_of_one"]
    (h,) = data["host"]
    assert (h["world"], h["causal"], h["balance"], h["calls_ok"]) == (2, True, "zigzag", True)
    (w,) = data["world_of_one"]
    assert w["seq"] == 16 and w["fwd_bwd_check_ok"] and w["tolerance"] == 1e-10  # float64's bound
    assert max(w["fwd_bwd_errors"].values()) < 1e-10


def test_cli_bench_world_of_one_alone(tmp_path, capsys):
    path = tmp_path / "w.json"
    code = main(
        ["bench", "--world-of-one", "--device", "cpu", "--seqs", "8,16", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "8", "--dtype", "float32", "--warmup", "0", "--quiet", "--json", str(path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "µs per step" not in out and "world of one" in out
    data = json.loads(path.read_text())
    assert data["host"] is None
    assert [(r["seq"], r["causal"]) for r in data["world_of_one"]] == [(8, False), (16, False), (8, True), (16, True)]
    assert all(r["fwd_check_ok"] and r["fwd_bwd_check_ok"] for r in data["world_of_one"])
    # the CPU backend has no whole_attention: the ratio is xcp's own kernel against SDPA, and says so
    assert not any(r["whole_attention"] for r in data["world_of_one"])
    text = " ".join(out.split())
    assert "xcp ran its own block kernel (the header's) under its autograd Function" in text
    assert "dispatch around it" not in text


def test_world_of_one_text_says_what_the_ratio_measures():
    from xcp.cli.bench.world_of_one import _path_text

    whole, own = [{"whole_attention": True}], [{"whole_attention": False}]
    assert _path_text(whole).endswith("so the ratio is the cost of xcp's checks and dispatch around it")
    assert _path_text(own).startswith("The backend has no whole_attention for these inputs")
    both = _path_text(whole + own)
    assert both.startswith("Where the backend's whole_attention took the call") and "own block kernel" in both


def test_world_of_one_defaults_to_1k_and_4k(capsys, monkeypatch):
    from xcp.cli import common

    monkeypatch.setattr(common, "available_bytes", lambda backend, device: 1)  # refuse, to see the sizes
    assert main(["bench", "--world-of-one", "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "the world of one at S=4096" in err and "H=8/2 D=64 float32" in err


def test_world_of_one_check_compares_with_sdpa(monkeypatch, capsys):
    """The check is real: an SDPA 1% off fails it, the row says FAIL and the exit status is 1."""
    import torch

    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **kw: real(*a, **kw) * 1.01)
    code = main(["bench", "--world-of-one", "--device", "cpu", "--seqs", "16", "--heads", "2", "--kv-heads", "1",
                 "--head-dim", "8", "--dtype", "float32", "--warmup", "0", "--mask", "full", "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "FAIL (9.9e-03)" in out  # 0.01 / 1.01


def test_host_check_catches_kernels_computed_while_timed(monkeypatch):
    from xcp.testing.doubles import NullKernels

    monkeypatch.setattr(NullKernels, "_cached", lambda self, key, compute: (self.__dict__.__setitem__(
        "computed", self.computed + 1), compute())[1])  # fmt: skip
    report = run_bench(tiny(host=True, world_of_one=True, worlds=[2], seqs=[8], host_tokens=4), progress=False)
    (r,) = report["host"]
    assert not r["calls_ok"] and r["kernels_computed_while_timed"] > 0
    assert "FAIL (2 calls/pass)" in format_report(report)


def test_null_kernels_return_the_first_outputs_and_stamp_each_call():
    import torch

    from xcp.backends.cpu import CPUBackend
    from xcp.cli.bench.host import per_step
    from xcp.testing.doubles import NullKernels

    null = NullKernels(CPUBackend())
    assert null.name == "cpu" and null.handoff_policy == "none"  # everything but the kernels is the backend's
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    first = null.forward(q, k, v, "causal", 0.3)
    null.recording = True
    again = null.forward(q + 1, k, v, "causal", 0.3)  # other values, same kind: not computed
    other = null.forward(q, k, v, "none", 0.3)  # another mask: computed once
    assert again is first and other is not first and null.computed == 2
    assert [kind for kind, _, _ in next(iter(null.stamps.values()))] == ["fwd", "fwd"]
    # passes are runs of one kind; a step is the time between two calls of one pass
    stamps = [("fwd", 0, 0), ("fwd", 2000, 4000), ("bwd", 5000, 9000), ("bwd", 9000, 9500), ("fwd", 9600, 9700),
              ("fwd", 13600, 11700)]  # fmt: skip
    assert per_step(stamps, "fwd") == ([2, 2], 3.0, 3.0)
    assert per_step(stamps, "bwd") == ([2], 4.0, 0.5)
    assert per_step(stamps[:1], "fwd")[0] == [1] and math.isnan(per_step(stamps[:1], "fwd")[1])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--worlds", "1,2"], "--worlds: expected integers >= 2 with --host"),
        (["--balance", "contiguous", "--mask", "causal"], "--balance: expected zigzag or stripe with --host"),
        (["--host-tokens", "3"], "--host-tokens: expected a multiple of 2 (balance 'zigzag' over 2 ranks); got 3"),
        (["--documents", "8,8"], "--documents: not measured with --host"),
        (["--window", "4,0"], "--window: not measured with --host"),
        (["--plot", "x.png"], "--plot: draws the dense grid"),
        (["--distributed"], "--host: measured in one process"),
    ],
)
def test_bench_host_refuses_what_it_does_not_measure(capsys, args, message):
    base = ["bench", "--host", "--device", "cpu", "--seqs", "16", "--worlds", "2", "--quiet"]
    assert main(base + args) == 2
    assert message in capsys.readouterr().err


# --- the hybrid all-to-all + ring (issue 15): --ulysses ---

ULYSSES_FLAGS = ["bench", "--device", "cpu", "--heads", "4", "--kv-heads", "1", "--head-dim", "4", "--dtype",
                 "float64", "--reps", "1", "--warmup", "0", "--quiet", "--seqs", "32", "--worlds", "4", "--mask",
                 "causal"]  # fmt: skip


def test_cli_bench_ulysses_checks_times_and_counts_the_bytes_of_each_u(tmp_path, capsys):
    """U = 1, 2, 4 over P = 4 (4 query heads over 1 K/V head, replicated for U = 2 and 4): each checked
    against the whole-sequence kernel, timed, and every rank's bytes per tag what the formula says."""
    path = tmp_path / "u.json"
    code = main([*ULYSSES_FLAGS, "--ulysses", "1,2,4", "--json", str(path)])
    text = capsys.readouterr().out
    assert code == 0, text
    data = json.loads(path.read_text())
    assert data["timing"] == [] and data["memory"] == [] and data["meta"]["config"]["ulysses"] == [1, 2, 4]
    rows = data["ulysses"]
    assert [(r["ulysses"], r["ring"], r["seq"], r["world"], r["causal"]) for r in rows] == [
        (1, 4, 32, 4, True), (2, 2, 32, 4, True), (4, 1, 32, 4, True)]  # fmt: skip
    item, n = 8, 32 // 4  # float64 (dK/dV accumulate in float64 too); S/P tokens per rank
    for r in rows:
        u, ring = r["ulysses"], r["ring"]
        for mode in ("fwd", "fwd_bwd"):
            assert r[f"{mode}_check_ok"] and max(r[f"{mode}_errors"].values()) < 1e-12, r[f"{mode}_errors"]
            assert math.isfinite(r[f"{mode}_ratio"]) and r[f"{mode}_ratio"] > 0
        hkv = max(1, u)  # lcm(1, U): the one K/V head replicated U times
        a2a = (u - 1) * n * (2 * 4 + 2 * hkv) * 4 * item // u  # q, k, v in and out back; the same backward
        shard = 2 * (32 // ring) * (hkv // u) * 4 * item  # a K/V shard of the ring, and a dK/dV message
        fwd = {"a2a": a2a, "kv": (ring - 1) * shard}
        fwd_bwd = {"a2a": 2 * a2a, "kv": 2 * (ring - 1) * shard, "dkv": ring * shard if ring > 1 else 0}
        assert r["sent_ok"] and r["sent_formula"] == {"fwd": dict(fwd, dkv=0), "fwd_bwd": fwd_bwd}
        assert r["fwd_sent_bytes"] == [{k: b for k, b in fwd.items() if b}] * 4  # counted at every rank
        assert r["fwd_bwd_sent_bytes"] == [{k: b for k, b in fwd_bwd.items() if b}] * 4
    lines = [line.split() for line in text.splitlines() if line.strip().startswith("32 ")]
    assert [line[:5] for line in lines] == [
        ["32", "4", u, r, "causal"] for u, r in (("1", "4"), ("2", "2"), ("4", "1"))
    ]
    assert lines[0][14:16] == ["0", "B"] and all(line[-2] == "ok" for line in lines)  # U = 1: no all-to-all
    assert [line[12] for line in lines] == [f"{r['fwd_bwd_ratio']:.3f}" for r in rows]


def test_bench_ulysses_check_is_against_the_whole_sequence_kernel(monkeypatch, capsys):
    """Given a yardstick that is not attention on the whole sequence (here: its output doubled), every U
    fails its check and the command exits 1."""
    from xcp.cli.bench import hybrid
    from xcp.cli.common import whole_kernel

    def doubled(backend, full, causal, backward):
        out, grads = whole_kernel(backend, full, causal, backward)
        return 2 * out, grads

    monkeypatch.setattr(hybrid, "whole_kernel", doubled)
    assert main([*ULYSSES_FLAGS, "--ulysses", "2,4"]) == 1
    assert capsys.readouterr().out.count("FAIL") == 2


def test_bench_ulysses_bytes_are_measured_not_assumed(monkeypatch, capsys):
    """Were the formula wrong (here: the all-to-all counting the rank's own piece too), the bytes counted at
    the communicators would disagree, and the command exits 1."""
    import dataclasses

    from xcp.cli.bench import hybrid

    real = hybrid.hybrid_traffic

    def own_piece_too(*args, **kw):
        t = real(*args, **kw)
        return dataclasses.replace(t, q=t.q * t.ulysses // (t.ulysses - 1)) if t.ulysses > 1 else t

    monkeypatch.setattr(hybrid, "hybrid_traffic", own_piece_too)
    assert main([*ULYSSES_FLAGS, "--ulysses", "1,2"]) == 1
    out = capsys.readouterr().out
    assert out.count("bytes MEASURED OTHERWISE") == 1 and "FAIL" in out  # U = 1 sends no all-to-all


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ulysses", "3"], "--ulysses: expected divisors of every --worlds value (P = U x R); 3 does not divide 4"),
        (["--ulysses", "2,4", "--worlds", "2,4"], "--ulysses: expected divisors of every --worlds value (P = U x R); "
         "4 does not divide 2"),
        (["--ulysses", "4", "--heads", "6", "--kv-heads", "2"], "--ulysses: expected divisors of --heads 6"),
        (["--ulysses", "2", "--seqs", "12", "--worlds", "8", "--balance", "stripe"],
         "--seqs: expected a multiple of 8 ranks with --ulysses 2 (each of the 4 ring shards is cut into 2 pieces); "
         "got 12"),
        (["--ulysses", "3", "--worlds", "6", "--heads", "6", "--seqs", "6"],
         "--seqs: balance 'zigzag' over 2 ranks needs a positive multiple of 4; got 6"),
        (["--ulysses", "2", "--window", "4,0"], "--window: not measured with --ulysses 2 yet; got '4,0'"),
        (["--ulysses", "2", "--documents", "16,16"], "--documents: not measured with --ulysses 2 yet; got '16,16'"),
        (["--ulysses", "2", "--host"], "--host: not measured with --ulysses 2 yet"),
        (["--ulysses", "1,2", "--plot", "x.png"], "--plot: not measured with --ulysses 1,2 yet; got 'x.png'"),
        (["--ulysses", "2", "--distributed"], "--ulysses: measured in one process (LocalWorld virtual ranks), not "
         "with --distributed yet; got 2"),
    ],
)  # fmt: skip
def test_bench_ulysses_bad_values_name_the_flag(capsys, args, message):
    assert main([*ULYSSES_FLAGS, *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"xcp bench: error: {message}"), captured.err


# --- --replay (issue 14): each ring replayed as one device graph holding every rank's work ---


class _Graph:
    """A stand-in device graph for the CPU: the capture runs the work eagerly, a replay only counts."""

    def __init__(self) -> None:
        self.captures = self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _graph_backend(name: str):
    """A CPU backend with stand-in graphs, capturing while inside ``capture_graph`` (so the ring takes its
    capture paths: slots from the workspace, event hand-offs, no agreement exchange)."""
    from xcp.backends.cpu import CPUBackend

    class GraphCPU(CPUBackend):
        graphs: list[_Graph] = []
        capturing = False

        def is_capturing(self) -> bool:
            return self.capturing

        def new_graph(self) -> _Graph:
            self.graphs.append(_Graph())
            return self.graphs[-1]

        @contextlib.contextmanager
        def capture_graph(self, graph):
            graph.captures += 1
            type(self).capturing = True
            try:
                yield
            finally:
                type(self).capturing = False

    GraphCPU.name = name
    return GraphCPU


REPLAY_FLAGS = ["bench", "--heads", "2", "--kv-heads", "1", "--head-dim", "4", "--dtype", "float64", "--reps", "2",
                "--warmup", "1", "--quiet", "--seqs", "16", "--worlds", "2", "--memory-worlds", "2", "--memory-seq",
                "16", "--no-graph", "--replay"]  # fmt: skip


@pytest.mark.parametrize("extra", [[], ["--documents", "6,10"], ["--window", "4,0", "--mask", "causal"],
                                   ["--ulysses", "1,2", "--worlds", "2"]])  # fmt: skip
def test_cli_bench_replay_checks_and_times_each_ring_as_graphs(tmp_path, capsys, extra):
    """--replay captures the whole-sequence call and the ring (every rank) into graphs after the eager
    warm-up, checks what the capture produced and times the replays: per mode, two graphs, each captured once
    and replayed 1 + reps times; the rows carry the replayed times, ratios and checks, the text a table."""
    backend_class = _graph_backend("bench-graph-cpu")
    path = tmp_path / "r.json"
    with installed(backend_class()):
        code = main(REPLAY_FLAGS + ["--device", "bench-graph-cpu", "--json", str(path)] + extra)
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(path.read_text())
    rows = report["timing"] + (report.get("documents") or []) + (report.get("ulysses") or [])
    assert rows and all(r["fwd_replay_check_ok"] and r["fwd_bwd_replay_check_ok"] for r in rows)
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            assert r[f"{mode}_replay_ratio"] == pytest.approx(r[f"{mode}_replay_ring_s"] / r[f"{mode}_replay_ref_s"])
            assert set(r[f"{mode}_replay_errors"]) == ({"out"} if mode == "fwd" else {"out", "dq", "dk", "dv"})
    graphs = [g for g in backend_class.graphs if g.captures or g.replays]  # the others: asked whether it has any
    assert len(graphs) == 4 * len(rows) and all(g.captures == 1 and g.replays == 3 for g in graphs)
    assert "replayed as device graphs" in text and "FAIL" not in text


def test_bench_replay_check_catches_a_captured_ring_that_is_wrong(monkeypatch, capsys):
    """A ring whose captured run writes wrong outputs fails the replay check (the eager one passing), and the
    bench exits 1."""
    from xcp.cli.bench import VirtualRing

    backend_class = _graph_backend("bench-graph-cpu-wrong")
    run = VirtualRing.run

    def wrong_when_captured(self, backward):
        results = run(self, backward)
        if backend_class.capturing:
            for _, out, _ in results:
                out.add_(1.0)
        return results

    monkeypatch.setattr(VirtualRing, "run", wrong_when_captured)
    with installed(backend_class()):
        code = main(REPLAY_FLAGS + ["--device", "bench-graph-cpu-wrong"])
    text = capsys.readouterr().out
    assert code == 1
    replayed = text[text.index("replayed as device graphs") :]
    assert "FAIL" in replayed and "FAIL" not in text[: text.index("replayed as device graphs")].split("check")[-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cpu"], "--replay: needs a backend with device graphs (cuda has them); backend 'cpu' has none"),
        (["--device", "cpu", "--host"], "--replay: applies to the ring timings, not to --host"),
        (["--device", "cpu", "--world-of-one"], "--replay: applies to the ring timings, not to --world-of-one"),
        (["--device", "cpu", "--distributed"], "--replay: measured in one process"),
    ],
)
def test_bench_replay_refuses_what_it_cannot_measure(capsys, args, message):
    assert main(REPLAY_FLAGS + args) == 2
    assert message in capsys.readouterr().err


# --- --decode: a decode step over a sharded KV cache against one whole-cache call ---

DECODE_FLAGS = ["bench", "--decode", "--device", "cpu", "--batch", "2", "--heads", "4", "--kv-heads", "2",
                "--head-dim", "8", "--dtype", "float64", "--reps", "2", "--warmup", "1", "--quiet", "--seqs", "32",
                "--worlds", "2,4"]  # fmt: skip


def test_cli_bench_decode_checks_times_and_sizes_each_cache(tmp_path, capsys):
    """Per (L, P): xcp's decode step over P virtual ranks checked against SDPA over the whole cache, then timed
    beside it (no graphs on the CPU); the bytes each rank's cache holds beside the whole cache's over P, the
    tokens each holds, the host µs of a step; the chunk of T tokens checked and timed likewise."""
    path = tmp_path / "decode.json"
    code = main([*DECODE_FLAGS, "--chunk", "3", "--json", str(path)])
    text = capsys.readouterr().out
    assert code == 0, text
    data = json.loads(path.read_text())
    assert data["meta"]["config"]["decode"] and data["meta"]["config"]["chunk"] == 3 and data["timing"] == []
    rows, chunks = data["decode"], data["chunk"]
    assert [(r["seq"], r["world"], r["batch"]) for r in rows] == [(32, 2, 2), (32, 4, 2)]
    for r in rows:
        assert r["decode_check_ok"] and r["decode_errors"]["xcp"] < 1e-12, r["decode_errors"]
        assert r["replay"] == "no graphs on cpu" and not r["flash"]  # no flash varlen op on the CPU either
        assert r["eager_xcp_over_sdpa"] == pytest.approx(r["eager_xcp_s"] / r["eager_sdpa_s"])
        assert math.isfinite(r["host_step_us"]) and r["host_step_us"] > 0
        steps = 1 + 1 + 2  # the checked step, one warm-up, two timed
        assert r["steps"] == steps and r["capacity"] == 32 + steps + 3 * (1 + 1 + 2) == r["tokens"]
        whole = 2 * 2 * r["capacity"] * 2 * 8 * 8  # K and V of the whole cache: B x N x Hkv x D float64
        assert r["whole_cache_bytes"] == whole and r["whole_cache_bytes_per_rank"] == whole / r["world"]
        share = 2 * 2 * (r["capacity"] // r["world"] + 1) * 2 * 8 * 8  # a rank's share and its scratch row
        assert r["cache_bytes"] == [share] * r["world"]
        assert r["tokens_ok"] and sum(r["tokens_per_rank"]) == r["tokens"]
    assert [(c["seq"], c["world"], c["chunk"], c["cached"], c["reference"]) for c in chunks] == [
        (32, 2, 3, 36, "sdpa"), (32, 4, 3, 36, "sdpa")]  # fmt: skip
    assert all(c["chunk_check_ok"] and c["chunk_errors"]["xcp"] < 1e-12 for c in chunks)
    assert "no graphs on cpu" in text and "host µs/step" in text and "whole/P" in text and "FAIL" not in text
    lines = [line.split() for line in text.splitlines() if line.strip().startswith("32 ")]
    assert [line[:2] for line in lines] == [["32", "2"], ["32", "4"]] * 3  # decode, per rank, chunk
    decode_lines, chunk_lines = lines[:2], lines[4:]
    assert [line[-1] for line in decode_lines] == [f"({r['decode_errors']['xcp']:.1e})" for r in rows]
    assert all(line[-2] == "ok" for line in decode_lines + chunk_lines)


def test_bench_decode_check_is_against_the_whole_cache(monkeypatch, capsys):
    """The check is real: a whole-cache reference 10% off fails it (the bound is bf16's, 2e-2, as for the ring
    figures), the rows say FAIL and the exit status is 1."""
    from xcp.cli.bench import decode

    real = decode.WholeCache.sdpa
    monkeypatch.setattr(decode.WholeCache, "sdpa", lambda self, q, at: real(self, q, at) * 1.1)
    assert main([*DECODE_FLAGS, "--worlds", "2", "--chunk", "2"]) == 1
    assert capsys.readouterr().out.count("FAIL (9.1e-02)") == 2  # the decode row and the chunk row


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replay"], "--replay: not measured with --decode (it replays its steps as device graphs"),
        (["--window", "4,0"], "--window: not measured with --decode; got '4,0'"),
        (["--mask", "full"], "--mask: --decode attends causally"),
        (["--seqs", "30"], "--seqs: balance 'zigzag' over 2 ranks needs a positive multiple of 4; got 30"),
        (["--distributed"], "--decode: measured in one process"),
    ],
)
def test_bench_decode_refuses_what_it_does_not_measure(capsys, args, message):
    assert main([*DECODE_FLAGS, "--worlds", "2", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_chunk_needs_decode(capsys):
    assert main(["bench", "--device", "cpu", "--chunk", "3", "--quiet"]) == 2
    assert "--chunk: expected together with --decode; got 3" in capsys.readouterr().err


# --- values of another head dim (--value-head-dim: multi-head latent attention, q/k 192 and v 128) ---

VALUE_FLAGS = ["bench", "--heads", "4", "--kv-heads", "2", "--head-dim", "12", "--value-head-dim", "8", "--dtype",
               "float64", "--reps", "1", "--warmup", "0", "--quiet"]  # fmt: skip
VALUE_MODES = {
    "dense": ["--seqs", "32", "--worlds", "2,4", "--mask", "causal", "--memory-seq", "32", "--memory-worlds", "2"],
    "documents": ["--documents", "6,10,16", "--worlds", "2", "--mask", "causal"],
    "window": ["--window", "4,0", "--seqs", "32", "--worlds", "4", "--balance", "contiguous"],
    "ulysses": ["--ulysses", "1,2", "--seqs", "32", "--worlds", "2", "--mask", "causal"],
    "host": ["--host", "--worlds", "2", "--host-tokens", "4", "--seqs", "16", "--mask", "causal"],
    "decode": ["--decode", "--seqs", "16", "--worlds", "2", "--chunk", "3"],
    "replay": ["--seqs", "16", "--worlds", "2", "--mask", "causal", "--memory-seq", "16", "--memory-worlds", "2",
               "--no-graph", "--replay"],
}  # fmt: skip


@pytest.mark.parametrize("mode", list(VALUE_MODES))
def test_cli_bench_values_of_another_head_dim(tmp_path, capsys, mode):
    """Every mode with --head-dim 12 --value-head-dim 8: the checks pass (v, out, dout, dv of 8 against the
    yardstick, the bytes sent against the formulas of K in 12 and V in 8), the header shows both dims and every
    row of the JSON has them."""
    path = tmp_path / "v.json"
    device = "bench-value-graph-cpu" if mode == "replay" else "cpu"
    with installed(_graph_backend(device)()) if mode == "replay" else contextlib.nullcontext():
        code = main([*VALUE_FLAGS, "--device", device, *VALUE_MODES[mode], "--json", str(path)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "D=12/8 float64" in text and "values of another head dim: q, k, dq, dk of D=12; v, out, dout, dv" in text
    report = json.loads(path.read_text())
    assert (report["meta"]["config"]["head_dim"], report["meta"]["config"]["value_head_dim"]) == (12, 8)
    tables = ("timing", "memory", "documents", "ulysses", "host", "world_of_one", "decode", "chunk")
    rows = [r for name in tables for r in report.get(name) or []]
    assert rows and all((r["head_dim"], r["value_head_dim"]) == (12, 8) for r in rows)
    if mode != "dense":
        return
    item, hkv = 8, 2  # float64 (dK/dV accumulate in float64 too)
    for r in report["timing"]:
        shard = (32 // r["world"]) * hkv * (12 + 8) * item  # K of 12 and V of 8 per token and K/V head
        assert r["fwd_sent_bytes"] == [{"kv": (r["world"] - 1) * shard}] * r["world"]  # counted at every rank
        assert r["fwd_bwd_sent_bytes"] == [{"kv": 2 * (r["world"] - 1) * shard, "dkv": r["world"] * shard}] * r["world"]
        flops = attention_flops(1, 32, 4, 12, True, True, 8)
        assert r["fwd_bwd_ring_tflops"] == pytest.approx(flops / r["fwd_bwd_ring_s"] / 1e12)
    assert [m["kv_shard_bytes"] for m in report["memory"]] == [16 * hkv * (12 + 8) * item] * 2


def test_bench_value_head_dim_needs_a_backend_that_takes_it(capsys):
    """A backend whose kernels take one head dim (value_head_dims False): run and bench refuse another value
    head dim by the flag, before anything runs; the same head dim runs."""
    from xcp.backends.cpu import CPUBackend

    class OneHeadDim(CPUBackend):
        name = "bench-one-head-dim"
        value_head_dims = False

    small = ["--heads", "2", "--kv-heads", "1", "--head-dim", "4", "--device", OneHeadDim.name]
    with installed(OneHeadDim()):
        for args in (["run", "--seq", "16", "--world", "2"], ["bench", "--seqs", "16", "--worlds", "2", "--quiet"]):
            assert main([*args, *small, "--value-head-dim", "6"]) == 2
            err = capsys.readouterr().err
            assert "--value-head-dim: expected --head-dim 4 with backend 'bench-one-head-dim'" in err, err
            assert "got 6" in err
        assert main(["run", "--seq", "16", "--world", "2", *small, "--value-head-dim", "4"]) == 0
