"""Mutation tests: break one lifetime rule at a time (by monkeypatching) and check the sanitizer says so.

Each test asserts the specific finding: its kind, and the op and stream of the accesses involved. The
mutations exist only here; the shipped code has no switch that turns them on.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import independent_reference

import xcp
from xcp import lifetime
from xcp.lifetime import RingCall, ShardSlots
from xcp.ring import RingConfig, ring_forward
from xcp.testing.decode_sanitizer import sanitize_decode
from xcp.testing.sanitizer import Sanitizer, sanitize_ring


def accesses(report, kind):
    """(op, stream, write) of both accesses of every finding of ``kind``."""
    return [tuple((a.op, a.stream, a.write) for a in f.accesses) for f in report.findings if f.kind == kind]


def test_receive_issued_without_waiting_for_the_previous_compute(monkeypatch):
    monkeypatch.setattr(RingCall, "comm_after_compute", lambda self: None)
    report = sanitize_ring(world=4)
    races = accesses(report, "race")

    # the previous rank's copy into a slot races with this rank's compute, which still reads the slot
    def compute_vs_incoming_copy(first, second):
        rank = int(first[1].split(":")[0][4:])
        return (
            first[1] == f"rank{rank}:C"
            and not first[2]
            and "p2p kv" in second[0]
            and second[1] == f"rank{(rank - 1) % 4}:M"
            and second[2]
        )

    assert any(compute_vs_incoming_copy(*pair) for pair in races), report.format()
    assert report.kinds() == {"race"}


def test_hand_off_skipped(monkeypatch):
    monkeypatch.setattr(RingCall, "hand_to_comm", lambda self, tensors, channel, ordered=False: list(tensors))
    report = sanitize_ring(world=4, backward=True)
    races = accesses(report, "race")
    # the dK/dV accumulators written on C are sent from M, which never waited for the additions
    assert any(
        first[1].endswith(":C") and first[2] and "p2p dkv" in second[0] and second[1].endswith(":M") and not second[2]
        for first, second in races
    ), report.format()
    assert report.kinds() == {"race"}
    assert sanitize_ring(world=4, backward=False).ok  # the forward orders its sends through rule 2's wait


def test_slot_reused_one_step_early(monkeypatch):
    monkeypatch.setattr(ShardSlots, "_key", lambda self, step: 0)  # the next shard lands in the one in use
    report = sanitize_ring(world=4)
    races = accesses(report, "race")

    # the shard arriving from the previous rank overwrites the slot this rank still reads, either in its
    # compute (C) or in its own send of that slot (M); which of the two readers a finding names depends on
    # thread timing, the race itself does not
    def slot_read_vs_incoming_copy(pair):
        reads = [a for a in pair if not a[2]]
        writes = [a for a in pair if a[2] and "p2p kv" in a[0]]
        if len(reads) != 1 or len(writes) != 1:
            return False
        dst = int(writes[0][0].split("->")[1].split(")")[0])
        return reads[0][1] in (f"rank{dst}:C", f"rank{dst}:M") and writes[0][1] == f"rank{(dst - 1) % 4}:M"

    assert any(slot_read_vs_incoming_copy(pair) for pair in races), report.format()
    assert "race" in report.kinds()


def ascend_case(handoff: str | None):
    """A tensor made on the compute stream X is read on the comm stream M, dropped, and X allocates again.

    ``handoff`` None skips the hand-off entirely; otherwise it goes through RingCall.hand_to_comm.
    """
    with Sanitizer() as san, san.thread("rank0"):
        be = san.backend
        compute = be.new_stream(name="X")
        with be.stream_context(compute):
            call = RingCall(xcp.LocalWorld(1).group(0), be, torch.device("cpu"), "bounded", handoff or "none")
            with call:
                t = torch.ones(64) * 2  # produced on X
                with call.on_comm():
                    sent = call.hand_to_comm([t], "kv")[0] if handoff else t
                    received = sent.sum()  # read on M, e.g. by a send
                del t, sent  # the caller moves on
                u = torch.empty(64)  # X allocates a block of the same size...
                u.fill_(1.0)  # ...and writes it
            del received, u
    return san.findings


def test_ascend_case_is_reported_without_hand_off():
    findings = ascend_case("none")  # ordered by an event, but nothing keeps the block from X's allocator
    reuse = [f for f in findings if f.kind == "reuse"]
    assert reuse, findings
    old, new = reuse[0].accesses
    assert (old.op, old.stream, old.write) == ("aten.sum.default", "rank0:M", False)
    assert new.stream == "rank0:X" and new.op.startswith("aten.empty.memory_format")
    skipped = ascend_case(None)  # no hand-off at all: also unordered with the write that made the tensor
    assert {"race", "reuse"} <= {f.kind for f in skipped}


@pytest.mark.parametrize("handoff", ["clone", "record_stream", "event"])
def test_ascend_case_is_clean_with_a_hand_off(handoff):
    assert ascend_case(handoff) == []


def free_early(monkeypatch):
    """Receive into a fresh buffer per step and drop the one two steps back (bounded by freeing)."""

    def slot(self, step, zero=False):
        for old in [k for k in self._slots if k < step - 1]:
            del self._slots[old]
            lifetime._uncount(self._tokens.pop(old))
        return ShardSlots.__dict__["_orig_slot"](self, step, zero)

    monkeypatch.setattr(ShardSlots, "_orig_slot", ShardSlots.slot, raising=False)
    monkeypatch.setattr(ShardSlots, "slot", slot)


def test_freeing_slots_early_needs_record_stream(monkeypatch):
    free_early(monkeypatch)
    unsafe = sanitize_ring(world=5, slots="keep_all", handoff="none")
    reuse = accesses(unsafe, "reuse")
    # a dropped slot's block goes back to C's pool while M's send still reads it
    assert any("p2p kv" in old[0] and old[1].endswith(":M") and new[1].endswith(":C") for old, new in reuse)
    assert sanitize_ring(world=5, slots="keep_all", handoff="record_stream").ok
    for handoff in ("event", "clone"):  # valid only by keeping the slot alive until the join: unbounded
        kept = sanitize_ring(world=5, slots="keep_all", handoff=handoff)
        assert kept.kinds() == {"bound"}
        assert all("received buffers peaked at 4096 B" in f.message for f in kept.findings)


@pytest.mark.parametrize("world", [4, 6])
def test_keep_all_exceeds_the_bound(world):
    report = sanitize_ring(world=world, slots="keep_all")
    assert report.kinds() == {"bound"}
    assert set(report.peak_kv_shards.values()) == {world - 1}
    ledger = [f for f in report.findings if "(ledger)" in f.message]
    measured = [f for f in report.findings if "(sanitizer)" in f.message]
    assert len(ledger) == len(measured) == world  # every rank, counted by the ring and measured by the model
    back = sanitize_ring(world=world, slots="keep_all", backward=True)
    assert back.kinds() == {"bound"} and min(back.peak_kv_shards.values()) > 4


def test_keep_all_within_the_bound_below_four_ranks():
    assert sanitize_ring(world=3, slots="keep_all").ok  # two received shards: no more than two slots


def caller_drops_kv_after_the_call():
    """P = 2: a call, then the caller drops its K and V and allocates on its stream."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 2, 4, generator=gen, dtype=torch.float64)
    with Sanitizer() as san:

        def rank(g):
            with san.thread(f"rank{g.rank()}"):
                ql, kl, vl = (xcp.shard(x, 2, g.rank()) for x in (q, q, q))
                # under "event" the join is what protects the caller's K and V (record_stream would mark them)
                cfg = RingConfig(g, san.backend, True, 1 / math.sqrt(4), handoff="event")
                out = ring_forward(ql, kl, vl, cfg)[0]
                del kl, vl  # M sent them at step 0; only the join orders that send before what C does next
                junk = torch.empty(ql.shape)
                junk.fill_(0.0)
                return out

        xcp.LocalWorld(2).run(rank)
    return san.findings


def test_join_skipped(monkeypatch):
    assert caller_drops_kv_after_the_call() == []

    def exit_without_join(self, *exc):
        self._keep.clear()
        for slots in self._slots:
            slots.release()

    monkeypatch.setattr(RingCall, "__exit__", exit_without_join)
    reuse = [f for f in caller_drops_kv_after_the_call() if f.kind == "reuse"]
    assert reuse
    old, new = reuse[0].accesses
    assert "p2p kv" in old.op and old.stream.endswith(":M") and not old.write and new.stream.endswith(":C")


def test_capture_mode_ignored(monkeypatch):
    from xcp.testing.sim_backend import SimBackend

    monkeypatch.setattr(SimBackend, "is_capturing", lambda self: False)  # the ring is not told about capture
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 12, 2, 4, generator=gen, dtype=torch.float64)
    with Sanitizer() as san:

        def rank(g):
            with san.thread(f"rank{g.rank()}"):
                ql = xcp.shard(q, 3, g.rank())
                with san.capture():  # no warm-up: slots made during capture, and record_stream used
                    ring_forward(ql, ql, ql, RingConfig(g, san.backend, True, 0.5, handoff="record_stream"))

        xcp.LocalWorld(3).run(rank)
        messages = [f.message for f in san.findings if f.kind == "capture"]
    assert any("record_stream during graph capture" in m for m in messages)
    assert any("received buffer was allocated during graph capture" in m for m in messages)


def test_verdict_does_not_depend_on_thread_timing(monkeypatch):
    monkeypatch.setattr(RingCall, "comm_after_compute", lambda self: None)

    def verdict(seed):
        report = sanitize_ring(world=5, backward=True, seed=seed)
        return {(f.kind, frozenset(a.stream for a in f.accesses)) for f in report.findings}

    # the same program gives the same kinds of findings between the same streams, whatever the threads'
    # interleaving (which of several equivalent access pairs a finding shows may differ)
    runs = [verdict(s) for s in (0, 0, 1)]
    assert runs[0] and runs[0] == runs[1] == runs[2]


# ---------------------------------------------------------------------------------- the KV cache's combine


@pytest.mark.parametrize("preallocated", [False, True])
def test_combine_hand_off_dropped(monkeypatch, preallocated):
    """Rule 3.3: without the hand-off, M's gather reads the packed partial C wrote without waiting for it
    (on the host-planned path and on the device path of a preallocated cache's decode steps alike)."""
    monkeypatch.setattr(RingCall, "hand_to_comm", lambda self, tensors, channel, ordered=False: list(tensors))
    report = sanitize_decode(world=3, decode=2, chunk=3 if not preallocated else 0, preallocated=preallocated)
    races = accesses(report, "race")
    assert any(
        first[1].endswith(":C")
        and first[2]
        and "p2p combine" in second[0]
        and second[1].endswith(":M")
        and not second[2]
        for first, second in races
    ), report.format()
    assert "race" in report.kinds() and report.kinds() <= {"race", "reuse"}


def test_combine_partial_reused_before_the_gather_reads_it():
    """Handed off under ``none`` on an asynchronous device, the dropped partial's block goes back to C's pool
    while M's gather still reads it: C's next allocation (the merge's output) takes it."""
    report = sanitize_decode(world=3, decode=2, chunk=3, handoff="none")
    reuse = accesses(report, "reuse")
    assert any(
        "p2p combine" in old[0]
        and old[1].endswith(":M")
        and not old[2]
        and new[1].endswith(":C")
        and new[0].startswith("aten.empty")
        for old, new in reuse
    ), report.format()
    assert report.kinds() == {"reuse"}


@pytest.mark.parametrize("handoff", [None, "clone", "event"])
@pytest.mark.parametrize("preallocated", [False, True])
def test_combine_is_clean_with_a_hand_off(handoff, preallocated):
    report = sanitize_decode(world=3, decode=2, chunk=3, handoff=handoff, preallocated=preallocated)
    assert report.ok, report.format()
    assert report.max_error["out"] < 1e-12


@pytest.mark.parametrize("handoff", [None, "clone"])
def test_combine_over_heads_is_clean_and_needs_its_hand_offs(monkeypatch, handoff):
    """A long chunk's combine over heads makes three collectives, each handing C's tensor to M: clean with
    the hand-offs (and exact), a race without them."""
    from xcp.comm.local import LocalGroup
    from xcp.inference import plan as cache_plan

    monkeypatch.setattr(cache_plan, "HEADS_COMBINE_MIN_QUERIES", 2)
    seen = []
    original = LocalGroup.all_to_all
    monkeypatch.setattr(LocalGroup, "all_to_all", lambda self, *a, **kw: seen.append(1) or original(self, *a, **kw))
    report = sanitize_decode(world=4, decode=1, chunk=5, handoff=handoff, combine="heads")
    assert report.ok, report.format()
    assert report.max_error["out"] < 1e-12 and len(seen) == 4  # the chunk's all-to-all on each rank
    monkeypatch.setattr(RingCall, "hand_to_comm", lambda self, tensors, channel, ordered=False: list(tensors))
    report = sanitize_decode(world=4, decode=1, chunk=5, handoff=handoff, combine="heads")
    assert any("p2p combine" in second[0] and second[1].endswith(":M") for _, second in accesses(report, "race"))


def test_sanitize_decode_command(capsys):
    from xcp.cli import main

    assert main(["sanitize", "--decode", "2", "--world", "2", "--chunk", "3", "--balance", "stripe"]) == 0
    assert "no finding" in capsys.readouterr().out
    assert main(["sanitize", "--decode", "2", "--world", "3", "--chunk", "0", "--capacity"]) == 0
    assert "no finding" in capsys.readouterr().out
    assert main(["sanitize", "--decode", "1", "--world", "2", "--handoff", "none"]) == 1


# ------------------------------------------------------------------------- two callers of one workspace


def two_callers(world=3):
    """Per rank: a call on the caller's stream C, then one from a second caller stream with its own inputs
    (made there before the first call, as another thread of the caller would); the findings, and both
    outputs against a float64 reference."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4 * world, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    with Sanitizer() as san:

        def rank(g):
            with san.thread(f"rank{g.rank()}"):
                be = san.backend
                mine = [xcp.shard(x, world, g.rank()) for x in (q, k, v)]
                second = be.new_stream(name="C2")
                be.wait_stream(second, be.current_stream())  # the second caller sees the inputs made...
                with be.stream_context(second):
                    theirs = [x.clone() for x in mine]  # ...and makes its own; nothing else orders the streams
                cfg = RingConfig(g, be, True, 0.5)
                first = ring_forward(*mine, cfg)[0]
                with be.stream_context(second):
                    later = ring_forward(*theirs, cfg)[0]
                be.wait_stream(be.current_stream(), second)
                return first, later

        results = xcp.LocalWorld(world).run(rank)
        findings = san.findings
    want = independent_reference(q, k, v, torch.ones_like(q), True).out
    errors = [(xcp.unshard([r[i] for r in results]) - want).abs().max().item() for i in range(2)]
    return findings, errors


def test_a_second_caller_stream_waits_for_the_workspace():
    findings, errors = two_callers()
    assert findings == [] and max(errors) < 1e-10  # float64: summation order only


@pytest.mark.parametrize("mutation", ["no wait", "no record"])
def test_a_second_caller_stream_that_does_not_wait_races_on_the_slots(monkeypatch, mutation):
    """Rule 1 across calls: the workspace's slots are ordered only by its ``ready`` event, recorded on the
    first caller's stream at the join and waited on by the next call."""
    if mutation == "no wait":
        never_ready = property(lambda self: None, lambda self, value: None)  # nothing to wait on
        monkeypatch.setattr(lifetime.Workspace, "ready", never_ready, raising=False)
    else:
        original = RingCall.__exit__

        def exit_without_record(self, *exc):
            ws, self.workspace = self.workspace, None  # the join, without recording ``ready``
            original(self, *exc)
            self.workspace = ws

        monkeypatch.setattr(RingCall, "__exit__", exit_without_record)
    findings, _ = two_callers()
    races = [f for f in findings if f.kind == "race"]
    assert races, findings
    # the first call's compute reading a slot (on C) against the second call's receive into it (a peer's copy)
    assert all(
        f.accesses[0].stream.endswith(":C") and not f.accesses[0].write and "p2p kv" in f.accesses[1].op for f in races
    ), findings
