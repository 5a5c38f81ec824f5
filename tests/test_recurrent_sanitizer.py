"""``xcp sanitize --recurrent``: state passing and halos, forward and backward, on the simulated device (and
``xcp bench --recurrent``, ``xcp plan --recurrent``).

Clean under every hand-off policy (and with documents under document_zigzag); with the hand-off of the
packed summaries and halos dropped (the buffer written on the caller's stream, read by the comm stream's
collective with nothing ordering them) the sanitizer reports the race, naming the packing."""

from __future__ import annotations

import pytest

from xcp.cli import main
from xcp.lifetime import RingCall
from xcp.testing.recurrent_sanitizer import sanitize_recurrent


@pytest.mark.parametrize("handoff", ["record_stream", "clone", "event", "none"])
def test_clean_under_every_hand_off_policy(handoff):
    report = sanitize_recurrent(world=3, handoff=handoff)
    assert report.ok, report.format()
    assert max(report.max_error.values()) <= 1e-12


def test_clean_with_documents():
    report = sanitize_recurrent(world=2, balance="document_zigzag", seq=9, documents=[0, 1, 5, 9])
    assert report.ok, report.format()


def test_dropped_hand_off_is_a_race(monkeypatch):
    monkeypatch.setattr(RingCall, "hand_to_comm", lambda self, tensors, channel, ordered=False: list(tensors))
    report = sanitize_recurrent(world=3)
    assert "race" in report.kinds(), report.format()
    assert "xcp/recurrent/exchange.py" in report.format() and "rank0:M" in report.format()


def test_sanitize_recurrent_command(capsys, monkeypatch):
    assert main(["sanitize", "--recurrent", "--world", "2", "--heads", "2", "--head-dim", "3"]) == 0
    assert "no finding" in capsys.readouterr().out
    assert main(["sanitize", "--recurrent", "--world", "2", "--balance", "stripe"]) == 2
    assert "balance: expected one of zigzag, contiguous, document_zigzag" in capsys.readouterr().err
    monkeypatch.setattr(RingCall, "hand_to_comm", lambda self, tensors, channel, ordered=False: list(tensors))
    assert main(["sanitize", "--recurrent", "--world", "2", "--heads", "2", "--head-dim", "3"]) == 1


def test_bench_recurrent_checks_then_times(capsys):
    pytest.importorskip("transformers", reason="needs transformers")
    assert main(["bench", "--recurrent", "--seqs", "64", "--worlds", "2", "--heads", "2", "--head-dim", "8",
                 "--reps", "1", "--warmup", "0", "--stack"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.count(" ok (largest error") == 4, out  # two layers, forward and forward+backward
    assert out.count("(pass 1 ") == 4 and out.count("pass 1 bwd ") == 2 and out.count("exchange ") == 4, out
    assert "transformers torch_chunk_gated_delta_rule (torch)" in out and "ok (attention error" in out, out
    assert main(["bench", "--stack"]) == 2
    assert "--stack: expected only with --recurrent" in capsys.readouterr().err


def test_plan_recurrent_bytes_do_not_grow_with_the_sequence(capsys):
    for seq in (64, 4096):
        sizes = ["--heads", "2", "--kv-heads", "2", "--head-dim", "4", "--dtype", "float32"]
        assert main(["plan", "--recurrent", "--world", "4", "--seq", str(seq), *sizes]) == 0
    first, second = (block.splitlines()[-1] for block in capsys.readouterr().out.split("xcp plan")[1:])
    # 2 pieces x 2 heads x (4 x 4 + 4 x 4) x 4 B, to 3 peers: 1.5 KiB; halos 2 x 3 x 24 channels x 4 B x 3
    assert first == second and "state 1.5 KiB" in first and "halo 1.7 KiB" in first, first


def test_plan_recurrent_under_ulysses_shows_the_hybrid_placement(capsys):
    sizes = ["--heads", "2", "--kv-heads", "2"]
    assert main(["plan", "--recurrent", "--world", "4", "--ulysses", "2", "--seq", "16", *sizes]) == 0
    out = capsys.readouterr().out
    # ring shards of zigzag over 2 positions: [0, 4) + [12, 16) and [4, 12), each cut in two
    assert "P=4 ulysses=2" in out and "rank 0: [0, 4)" in out and "rank 1: [12, 16)" in out, out
    assert "rank 2: [4, 8)" in out and "rank 3: [8, 12)" in out, out


def test_plan_recurrent_describes_a_mamba2_layer(capsys):
    sizes = ["--heads", "2", "--kv-heads", "2", "--head-dim", "4", "--state-dim", "8", "--dtype", "bfloat16"]
    assert main(["plan", "--recurrent", "--layer", "mamba2", "--world", "4", "--seq", "64", *sizes]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    # 2 pieces x 2 heads x (1 decay + 4 x 8 state) x 4 B (float32 states), to 3 peers: 1584 B; halos
    # 2 x 3 x (2 x 4 + 2 x 8 channels: x, B, C) x 2 B x 3: 864 B
    assert "state 1.5 KiB" in last and "halo 864 B" in last, last
    assert main(["plan", "--layer", "mamba2", "--world", "2", "--seq", "8"]) == 2
    assert "--layer: expected only with --recurrent; got mamba2 without it" in capsys.readouterr().err
    assert main(["plan", "--recurrent", "--world", "2", "--seq", "8", "--state-dim", "4"]) == 2
    assert "--state-dim: expected only with --layer mamba2" in capsys.readouterr().err
