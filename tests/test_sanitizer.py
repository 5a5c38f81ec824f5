"""The lifetime sanitizer: the model's checker on small programs, and the real ring on the sim device.

The ring must come out clean for every configuration Hypothesis draws (P in 1..8, causal or not, every
balance, GQA, dtypes, forward and backward, every hand-off policy), with at most 2 received shards alive
per rank forward and 4 backward, nothing left live, and numbers equal to a float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from helpers import independent_reference
from hypothesis import HealthCheck, given, settings
from strategies import sanitizer_configs, sanitizer_document_configs

import xcp
from xcp import plugins
from xcp.lifetime import HANDOFF_POLICIES, track_buffers
from xcp.ring import RingConfig, ring_forward
from xcp.testing.sanitizer import TOLERANCE, Sanitizer, sanitize_ring

# ----------------------------------------------------------------------------------------------------
# the checker itself


def kinds(findings):
    return sorted(f.kind for f in findings)


def test_unordered_write_and_read_on_two_streams_is_a_race():
    with Sanitizer() as san, san.thread("r0"):
        be = san.backend
        other = be.new_stream()
        t = torch.ones(8) * 3  # written on r0:C
        with be.stream_context(other):
            t.sum()  # read on r0:M, nothing orders it after the write
    (race,) = san.findings
    assert race.kind == "race"
    first, second = race.accesses
    assert (first.op, first.stream, first.write) == ("aten.mul.Tensor", "r0:C", True)
    assert (second.op, second.stream, second.write) == ("aten.sum.default", "r0:M", False)
    assert first.tensor == "float32[8]" and "tests/test_sanitizer.py" in first.storage
    text = race.format()
    assert "[race]" in text and "aten.sum.default on stream r0:M" in text and "float32[8]" in text


@pytest.mark.parametrize("order", ["event", "wait_stream", "host_sync"])
def test_events_stream_waits_and_host_syncs_order_accesses(order):
    with Sanitizer() as san, san.thread("r0"):
        be = san.backend
        caller, other = be.current_stream(), be.new_stream()
        t = torch.ones(8) * 3
        if order == "event":
            ev = be.new_event()
            be.record_event(ev, caller)
            be.wait_event(other, ev)
        elif order == "wait_stream":
            be.wait_stream(other, caller)
        else:
            ev = be.new_event()
            be.record_event(ev, caller)
            be.synchronize_event(ev)  # the host knows the write is done before it issues the read
        with be.stream_context(other):
            t.sum()
    assert san.findings == []


def test_reads_on_two_streams_do_not_conflict():
    with Sanitizer() as san, san.thread("r0"):
        be = san.backend
        t = torch.ones(4)
        ev = be.new_event()
        be.record_event(ev, be.current_stream())
        other = be.new_stream()
        be.wait_event(other, ev)
        with be.stream_context(other):
            t.sum()
        t.sum()
    assert san.findings == []


def produced_read_elsewhere_then_reallocated(mark: str | None):
    """t made on C, read on M (ordered), dropped, then a same-size allocation on C."""
    with Sanitizer() as san, san.thread("r0"):
        be = san.backend
        caller, other = be.current_stream(), be.new_stream()
        t = torch.ones(16) + 1
        be.wait_stream(other, caller)
        with be.stream_context(other):
            total = t.sum()
        if mark == "record_stream":
            be.record_stream(t, other)
        elif mark == "join":
            be.wait_stream(caller, other)
        del t
        u = torch.empty(16)
        u.fill_(0.0)
        del total, u
    return san.findings


def test_reuse_of_a_block_another_stream_still_reads_is_reported():
    findings = produced_read_elsewhere_then_reallocated(None)
    assert "reuse" in kinds(findings)
    reuse = next(f for f in findings if f.kind == "reuse")
    old, new = reuse.accesses
    assert (old.op, old.stream, old.write) == ("aten.sum.default", "r0:M", False)
    assert new.stream == "r0:C" and new.op.startswith("aten.empty.memory_format")


@pytest.mark.parametrize("mark", ["record_stream", "join"])
def test_record_stream_or_a_join_makes_reuse_safe(mark):
    assert produced_read_elsewhere_then_reallocated(mark) == []


def test_leaks_name_where_the_buffer_was_made():
    with Sanitizer() as san:
        with san.thread("r0"):
            kept = torch.zeros(5, dtype=torch.float64) + 1
        (leak,) = san.leaks()
        del kept
        assert san.leaks() == []
    assert leak.kind == "leak" and "float64[5]" in leak.message and "tests/test_sanitizer.py" in leak.message


def test_record_stream_while_capturing_is_reported():
    with Sanitizer() as san, san.thread("r0"):
        be = san.backend
        t = torch.ones(2)
        with san.capture():
            assert be.is_capturing()
            be.record_stream(t, be.new_stream())
        assert not be.is_capturing()
    assert kinds(san.findings) == ["capture"]


def test_sim_backend_outside_a_sanitizer_thread_is_a_clear_error():
    with Sanitizer() as san:
        with pytest.raises(RuntimeError, match="outside a sanitizer thread"):
            san.backend.current_stream()


def test_session_registers_sim_only_while_open():
    with Sanitizer() as san:
        assert plugins.get_backend("sim") is san.backend
    with pytest.raises(RuntimeError, match="'sim' is unknown"):
        plugins.get_backend("sim")


# ----------------------------------------------------------------------------------------------------
# the ring on the sim device

BOUND = {False: 2, True: 4}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sanitizer_configs())
def test_ring_is_clean_and_bounded_on_the_sim_device(cfg):
    report = sanitize_ring(**cfg)
    assert report.ok, report.format()
    bound = BOUND[cfg["backward"]]
    assert max(report.peak_kv_shards.values()) <= bound
    assert max(report.peak_comm_bytes.values(), default=0) <= report.bound_comm_bytes
    if cfg["world"] > 2:  # both slots are in use once a rank receives two shards or more
        assert min(report.peak_kv_shards.values()) == bound
    tol = TOLERANCE[cfg["dtype"]]
    assert set(report.max_error) == ({"out", "dq", "dk", "dv"} if cfg["backward"] else {"out"})
    assert all(err <= tol for err in report.max_error.values())


def test_repeated_calls_reuse_the_workspace_cleanly():
    report = sanitize_ring(world=4, backward=True, calls=3, handoff="record_stream")
    assert report.ok, report.format()
    assert set(report.peak_kv_shards.values()) == {4}


def test_report_format_lists_config_and_peaks():
    report = sanitize_ring(world=3, backward=True)
    text = report.format()
    assert "world=3" in text and "backward=True" in text and "handoff=record_stream" in text
    assert "rank 2: peak 4 received shards (bound 4)" in text
    assert "no finding" in text


def test_a_world_left_open_keeps_its_workspace_which_leaks_counts_until_released():
    """docs/lifetime.md's example: a world left open holds two receive slots per rank (its workspace, kept
    on purpose), which leaks() reports; released (or the world closed), nothing is left."""
    q, k, v = (torch.randn(1, 32, 2, 8, dtype=torch.float64) for _ in range(3))
    with Sanitizer() as san:

        def rank(g):
            with san.thread(f"rank{g.rank()}"):
                local = (xcp.shard(x, g.size(), g.rank()) for x in (q, k, v))
                xcp.attention(*local, group=g, device="sim")

        world = xcp.LocalWorld(4)
        world.run(rank)
        kept = san.leaks()
        assert len(kept) == 8 and all("xcp/lifetime.py" in f.message for f in kept)
        assert sorted(f.message.split(":")[0] for f in kept) == [f"rank{r}" for r in range(4) for _ in range(2)]
        world.release_buffers()
        assert san.leaks() == [] and san.findings == []
        world.close()


def test_attention_api_with_autograd_runs_clean_on_sim():
    world = 3
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4 * world, 4, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 4 * world, 2, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 4 * world, 2, 4, generator=gen, dtype=torch.float64)
    with Sanitizer() as san:

        def rank(g):
            with san.thread(f"rank{g.rank()}"), track_buffers() as led:
                ql, kl, vl = (xcp.shard(x, world, g.rank()).requires_grad_() for x in (q, k, v))
                out = xcp.attention(ql, kl, vl, causal=True, group=g, device="sim", handoff="clone")
                out.sum().backward()
                return led.peak_kv_shards, led.live_bytes, out.detach(), ql.grad

        results = xcp.LocalWorld(world).run(rank)
        assert san.findings == []
    want = independent_reference(q, k, v, torch.ones_like(q), True)  # the gradient of out.sum()
    assert [r[:2] for r in results] == [(4, 0)] * world
    assert (xcp.unshard([r[2] for r in results]) - want.out).abs().max() < 1e-10  # float64: summation order only
    assert (xcp.unshard([r[3] for r in results]) - want.dq).abs().max() < 1e-10


@pytest.mark.parametrize("handoff", HANDOFF_POLICIES)
def test_graph_capture_after_warm_up_allocates_nothing_and_never_marks_streams(handoff):
    """Rule 4 under every hand-off policy: ``record_stream`` and ``clone`` become ``event`` while capturing
    (a clone per send would allocate in the captured loop)."""
    world = 3
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4 * world, 2, 4, generator=gen, dtype=torch.float64)
    with Sanitizer() as san:

        def rank(g):
            with san.thread(f"rank{g.rank()}"):
                ql = xcp.shard(q, world, g.rank())
                cfg = RingConfig(g, san.backend, True, 0.5, handoff=handoff)
                ring_forward(ql, ql, ql, cfg)  # warm-up fills the workspace
                marks = san.model.record_stream_calls
                with san.capture(), track_buffers() as led:
                    out = ring_forward(ql, ql, ql, cfg)[0]
                return led.allocations, led.peak_kv_shards, out, marks

        results = xcp.LocalWorld(world).run(rank)
        assert san.findings == []
        assert san.model.record_stream_calls == max(r[3] for r in results)  # none during capture
    assert [r[:2] for r in results] == [(0, 2)] * world
    want = independent_reference(q, q, q, torch.ones_like(q), True).out  # scale 0.5 = 1/sqrt(head_dim)
    assert (xcp.unshard([r[2] for r in results]) - want).abs().max() < 1e-10  # float64: summation order only


def test_sanitize_ring_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world: expected an integer >= 1; got 0"):
        sanitize_ring(world=0)
    with pytest.raises(ValueError, match="kv_heads: expected a divisor of heads=4; got 3"):
        sanitize_ring(kv_heads=3)
    with pytest.raises(ValueError, match="handoff: expected one of"):
        sanitize_ring(handoff="copy")
    with pytest.raises(ValueError, match="seq: balance 'zigzag' over 4 ranks needs a positive multiple of 8"):
        sanitize_ring(world=4, seq=12)


# ----------------------------------------------------------------------------------------------------
# packed documents (issue 11): blocks with nothing to compute change nothing that is alive


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sanitizer_document_configs())
def test_ring_with_documents_is_clean_and_bounded_on_the_sim_device(cfg):
    report = sanitize_ring(**cfg)
    assert report.ok, report.format()
    assert report.config["documents"] == cfg["documents"] and len(report.document_lengths) == cfg["documents"]
    assert sum(report.document_lengths) == cfg["seq"]
    assert max(report.peak_kv_shards.values()) <= BOUND[cfg["backward"]]
    assert max(report.peak_comm_bytes.values(), default=0) <= report.bound_comm_bytes
    assert 1 <= report.ring_steps <= cfg["world"]
    if report.ring_steps == 1:  # a ring of one step moves nothing
        assert set(report.peak_kv_shards.values()) == {0}
    assert all(err <= TOLERANCE[cfg["dtype"]] for err in report.max_error.values())


@pytest.mark.parametrize(
    "cfg",
    [
        dict(world=4, documents=5, backward=True),
        dict(world=4, documents=7, causal=False, balance="stripe", backward=True, handoff="clone"),
        dict(world=5, documents=4, balance="contiguous", causal=False),
        dict(world=3, documents=2, seq=12, backward=True, handoff="event"),
    ],
)
def test_documents_leave_what_is_alive_as_the_dense_ring_does(cfg):
    """Where the ring runs all P steps, empty blocks (nothing computed) keep both slots in their rhythm: the
    peaks of received shards and bytes per rank are those of the same ring without documents."""
    report = sanitize_ring(**cfg)
    dense = sanitize_ring(**{**cfg, "documents": None, "seq": report.config["seq"]})
    assert report.ok and dense.ok, report.format() + "\n" + dense.format()
    assert report.ring_steps == cfg["world"]
    assert report.peak_kv_shards == dense.peak_kv_shards
    assert set(report.peak_kv_shards.values()) == {BOUND[cfg.get("backward", False)]}
    assert report.peak_comm_bytes == dense.peak_comm_bytes
    assert min(report.document_lengths) == 1
    assert report.format().count("documents: ") == 1 and "with the document mask" in report.format()


def test_documents_numerics_are_checked_against_the_document_mask(monkeypatch):
    """The reference really is masked by documents: with the plain causal mask in its place, the ring's
    output (which honours the documents) is a numerics finding."""
    from xcp.testing import sanitizer

    monkeypatch.setattr(sanitizer, "document_mask", lambda cu, causal: torch.ones(cu[-1], cu[-1]).tril().bool())
    report = sanitize_ring(world=2, documents=3, seq=8)
    assert report.kinds() == {"numerics"}, report.format()
    assert "out: error" in report.format() and "with the document mask" in report.format()


def test_random_document_lengths():
    from xcp.testing.sanitizer import random_document_lengths

    for seq, n in [(16, 1), (16, 2), (16, 5), (16, 16), (64, 30)]:
        lengths = random_document_lengths(seq, n, seed=7)
        assert len(lengths) == n and sum(lengths) == seq and min(lengths) >= 1
        assert lengths == random_document_lengths(seq, n, seed=7)
        assert n == 1 or min(lengths) == 1  # a 1-token document whenever there are two or more
    assert random_document_lengths(64, 8, seed=1) != random_document_lengths(64, 8, seed=2)
    with pytest.raises(ValueError, match=r"documents: expected at most seq=8 documents \(each at least 1 token\); "
                                         r"got 9"):  # fmt: skip
        random_document_lengths(8, 9)
    with pytest.raises(ValueError, match="batch: expected 1 with documents"):
        sanitize_ring(world=2, documents=2, batch=2)


def test_default_length_makes_room_for_every_document():
    report = sanitize_ring(world=2, documents=13)  # 4 tokens per rank would hold 8
    assert report.ok and report.config["seq"] == 16 and len(report.document_lengths) == 13


# ----------------------------------------------------------------------------------------------------
# sliding windows (issue 12): a ring of fewer steps, within the same bounds, against the banded mask


def window_steps(seq, world, balance, causal, window):
    """Brute force: one more than the last step at which some rank's queries see a key of the shard held."""
    from xcp.schedule import shard_indices

    left, right = (seq if x is None else x for x in window)
    last = 0
    for r in range(world):
        for step in range(world):
            keys = shard_indices(seq, world, (r - step) % world, balance)
            if any(i - left <= j <= i + right and (not causal or j <= i)
                   for i in shard_indices(seq, world, r, balance) for j in keys):  # fmt: skip
                last = max(last, step)
    return last + 1


@pytest.mark.parametrize(
    "cfg",
    [
        dict(world=4, balance="contiguous", window=(3, 0), backward=True),  # 2 of 4 steps
        dict(world=4, balance="contiguous", window=(0, 0), backward=True),  # the own shard: nothing moves
        dict(world=4, balance="zigzag", window=(3, 0), backward=True, handoff="clone"),  # all 4
        dict(world=5, balance="stripe", causal=False, window=(2, 6), backward=True, dtype=torch.float32),
        dict(world=4, balance="contiguous", causal=False, window=(None, 1), seq=32, backward=True, handoff="event"),
        dict(world=4, balance="contiguous", window=(6, None), documents=5, seq=32, backward=True),
        dict(world=3, balance="contiguous", window=(1, 0), calls=2),
    ],
)
def test_ring_with_a_window_is_clean_and_bounded_on_the_sim_device(cfg):
    report = sanitize_ring(**cfg)
    assert report.ok, report.format()
    seq, world, causal = report.config["seq"], cfg["world"], cfg.get("causal", True)
    if "documents" not in cfg:
        assert report.ring_steps == window_steps(seq, world, cfg["balance"], causal, cfg["window"])
    bound = BOUND[cfg.get("backward", False)]
    assert max(report.peak_kv_shards.values()) <= bound
    assert max(report.peak_comm_bytes.values(), default=0) <= report.bound_comm_bytes
    if report.ring_steps == 1:
        assert set(report.peak_kv_shards.values()) == {0}  # nothing received at all
    text = report.format()
    assert f"the ring ran {report.ring_steps} of {world} steps" in text
    assert ("with the banded document mask" if "documents" in cfg else "with the banded mask") in text
    assert all(err <= TOLERANCE[cfg.get("dtype", torch.float64)] for err in report.max_error.values())


def test_window_numerics_are_checked_against_the_banded_mask(monkeypatch):
    """The reference really is banded: with the window's mask replaced by no mask, the ring's output (which
    honours the window) is a numerics finding."""
    from xcp.testing import sanitizer

    monkeypatch.setattr(sanitizer, "window_mask", lambda seq, window: torch.ones(seq, seq, dtype=torch.bool))
    report = sanitize_ring(world=2, balance="contiguous", window=(2, 0))
    assert report.kinds() == {"numerics"}, report.format()
    assert "against float64 SDPA with the banded mask exceeds" in report.format()


def test_sanitize_ring_rejects_bad_windows():
    with pytest.raises(ValueError, match="window: with causal=True the right side must be 0 or None; got right=2"):
        sanitize_ring(world=2, window=(3, 2))
    with pytest.raises(ValueError, match="batch: expected 1 with a window"):
        sanitize_ring(world=2, window=(3, 0), batch=2)
    assert sanitize_ring(world=2, window=(None, 0)).window is None  # bounds nothing: the dense ring


# ----------------------------------------------------------------------------------------------------
# values of another head dim (multi-head latent attention): K in q/k's head dim, V in its own


@pytest.mark.parametrize(
    ("cfg", "dims"),
    [
        (dict(world=4, backward=True), (12, 8)),
        (dict(world=3, backward=True, documents=3, handoff="clone"), (8, 12)),
        (dict(world=4, backward=True, ulysses=2, dtype=torch.bfloat16), (12, 8)),
        (dict(world=4, window=(3, 0), balance="contiguous"), (12, 8)),
    ],
    ids=["dense", "documents-wider-v", "ulysses-bf16", "window"],
)
def test_ring_with_values_of_another_head_dim_is_clean_and_bounded(cfg, dims):
    """The ring (and the hybrid) with v of another head dim: no finding, every tensor within the dtype's
    bound, and the received buffers peak at exactly their bound, two shards of K in D and V in Dv (forward;
    and two dK/dV messages backward): v's dim in the bound is what the ring allocates, wider or narrower."""
    report = sanitize_ring(head_dim=dims[0], value_head_dim=dims[1], **cfg)
    assert report.ok, report.format()
    assert report.config["head_dim"] == f"{dims[0]}/{dims[1]}" and f"head_dim={dims[0]}/{dims[1]}" in report.format()
    dtype, u, backward = cfg.get("dtype", torch.float64), cfg.get("ulysses", 1), cfg.get("backward", False)
    assert set(report.max_error) == ({"out", "dq", "dk", "dv"} if backward else {"out"})
    assert all(err <= TOLERANCE[dtype] for err in report.max_error.values())
    elements = report.config["seq"] // (cfg["world"] // u) * (2 // u) * sum(dims)  # S/R tokens, H_kv/U heads, K and V
    shard, message = elements * dtype.itemsize, elements * (8 if dtype == torch.float64 else 4)
    assert report.bound_comm_bytes == 2 * shard + (2 * message if backward else 0)
    if report.ring_steps > 2:
        assert max(report.peak_comm_bytes.values()) == report.bound_comm_bytes


@pytest.mark.parametrize("preallocated", [False, True])
def test_decode_with_values_of_another_head_dim_is_clean(preallocated):
    from xcp.testing.decode_sanitizer import sanitize_decode

    report = sanitize_decode(world=3, decode=2, chunk=3, head_dim=12, value_head_dim=8, preallocated=preallocated)
    assert report.ok, report.format()
    assert report.config["head_dim"] == "12/8" and report.max_error["out"] < 1e-12
    with pytest.raises(ValueError, match="value_head_dim: expected an integer >= 1; got 0"):
        sanitize_decode(value_head_dim=0)
    with pytest.raises(ValueError, match="value_head_dim: expected an integer >= 1; got 0"):
        sanitize_ring(value_head_dim=0)
