"""Buffer lifetimes on the CPU backend: slot bounds, the ledger, the workspace, hand-off and capture mode.

The happens-before side of the rules is checked on the simulated device (test_sanitizer*.py); here the
ring runs on plain CPU threads and we check what the ledger and the workspace say, against a float64
reference where numbers are involved.
"""

from __future__ import annotations

import math

import pytest
import torch

import xcp
from xcp import lifetime
from xcp.backends.cpu import CPUBackend
from xcp.comm import LocalWorld
from xcp.comm.protocol import SingleRank
from xcp.lifetime import RingCall, ShardSlots, Workspace, track_buffers, workspace_disabled
from xcp.ring import RingConfig, ring_backward, ring_forward
from xcp.testing.reference import sdpa_reference


def inputs(world, heads=4, kv_heads=2, per_rank=4, dim=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq = per_rank * world
    q = torch.randn(1, seq, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, seq, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, seq, kv_heads, dim, generator=gen, dtype=torch.float64)
    do = torch.randn(1, seq, heads, dim, generator=gen, dtype=torch.float64)
    return q, k, v, do


def run_ring(world, backend=None, slots="bounded", handoff=None, causal=True, calls=1, seed=0):
    """Forward and backward on every rank; per rank: forward ledger, backward ledger, results."""
    q, k, v, do = inputs(world, seed=seed)
    backend = backend or CPUBackend()
    scale = 1 / math.sqrt(q.shape[-1])

    def rank(g):
        ql, kl, vl, dl = (xcp.shard(x, world, g.rank()) for x in (q, k, v, do))
        cfg = RingConfig(g, backend, causal, scale, "zigzag", slots, handoff)
        ledgers = []
        for _ in range(calls):
            with track_buffers() as fwd:
                out, lse = ring_forward(ql, kl, vl, cfg)
            with track_buffers() as bwd:
                grads = ring_backward(dl, ql, kl, vl, out, lse, cfg)
            ledgers.append((fwd, bwd))
        return ledgers, (out, *grads)

    return (q, k, v, do), LocalWorld(world).run(rank)


def check_numbers(tensors, results, causal=True):
    q, k, v, do = (x.clone().requires_grad_() for x in tensors)
    ref = sdpa_reference(q, k, v, causal)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), do))
    for i, w in enumerate(want):
        got = xcp.unshard([r[1][i] for r in results])
        assert (got - w).abs().max().item() < 1e-10  # float64 throughout: only summation order differs


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_two_slots_forward_four_backward_whatever_the_world(world):
    tensors, results = run_ring(world)
    check_numbers(tensors, results)
    for ledgers, _ in results:
        fwd, bwd = ledgers[0]
        assert fwd.peak_kv_shards == min(2, world - 1)  # P = 2 receives a single shard
        assert bwd.peak_kv_shards == (4 if world > 2 else 3 if world == 2 else 0)
        assert fwd.live_bytes == 0 and bwd.live_bytes == 0
        assert fwd.live_kv_shards == 0 and bwd.live_kv_shards == 0


def test_keep_all_keeps_every_received_shard():
    world = 5
    tensors, results = run_ring(world, slots="keep_all")
    check_numbers(tensors, results)
    for ledgers, _ in results:
        fwd, bwd = ledgers[0]
        assert fwd.peak_kv_shards == world - 1
        assert bwd.peak_kv_shards == (world - 1) + (world + 1)  # KV shards and dKV accumulators, all kept
        assert fwd.live_bytes == 0 and bwd.live_bytes == 0
        assert fwd.allocations == world - 1  # one fresh buffer per received shard, each counted as made


def test_ledger_and_slots_defaults():
    ledger = lifetime.BufferLedger()
    assert (ledger.live_bytes, ledger.peak_bytes, ledger.live_kv_shards, ledger.peak_kv_shards) == (0, 0, 0, 0)
    assert ledger.allocations == 0 and "_live" not in repr(ledger) and "_next" not in repr(ledger)
    tokens = [ledger.add(100), ledger.add(50, shards=0, new=False)]  # a shard, made anew, by default
    assert (ledger.live_kv_shards, ledger.allocations, ledger.live_bytes) == (1, 1, 150)
    for token in tokens:
        ledger.release(token)
    assert (ledger.live_bytes, ledger.live_kv_shards, ledger.peak_bytes) == (0, 0, 150)
    like = [torch.zeros(2, 3)]
    with track_buffers() as led:
        slots = ShardSlots(like)  # bounded: both ping-pong slots made up front
        assert led.allocations == 2 and slots.slot(0) is not slots.slot(1) and slots.slot(2) is slots.slot(0)
        call = RingCall(LocalWorld(1).group(0), CPUBackend(), torch.device("cpu"), "bounded", None)
        call.slots("kv", like)  # steps (0, 1) by default: two more slots
        assert led.allocations == 4


def test_capture_without_the_workspace_is_refused(recording):
    recording.capturing = True
    with workspace_disabled(), pytest.raises(RuntimeError, match=r"graph capture needs the workspace"):
        RingCall(LocalWorld(1).group(0), recording, torch.device("cpu"), "bounded", None)


def test_repeated_calls_allocate_nothing_new():
    world = 4
    _, results = run_ring(world, calls=3)
    for ledgers, _ in results:
        (fwd0, bwd0), *later = ledgers
        assert fwd0.allocations == 2 and bwd0.allocations == 2  # 2 KV slots, then 2 dKV slots (KV reused)
        for fwd, bwd in later:
            assert fwd.allocations == 0 and bwd.allocations == 0
            assert fwd.peak_kv_shards == 2 and bwd.peak_kv_shards == 4  # still counted while in use


def test_without_workspace_every_call_allocates():
    world = 3
    q, k, v, _ = inputs(world)

    def rank(g):
        ql, kl, vl = (xcp.shard(x, world, g.rank()) for x in (q, k, v))
        cfg = RingConfig(g, CPUBackend(), True, 0.5)
        counts = []
        with workspace_disabled():
            for _ in range(2):
                with track_buffers() as led:
                    ring_forward(ql, kl, vl, cfg)
                counts.append(led.allocations)
        return counts

    assert LocalWorld(world).run(rank) == [[2, 2]] * world


def test_workspace_is_used_again_after_workspace_disabled_and_cleared():
    world = 3
    q, k, v, _ = inputs(world)

    def rank(g):
        ql, kl, vl = (xcp.shard(x, world, g.rank()) for x in (q, k, v))
        cfg = RingConfig(g, CPUBackend(), True, 0.5)

        def allocations():
            with track_buffers() as led:
                ring_forward(ql, kl, vl, cfg)
            return led.allocations

        counts = []
        with workspace_disabled():
            with workspace_disabled():  # nested: leaving the inner block keeps the outer one's setting
                counts.append(allocations())
            counts.append(allocations())
        counts += [allocations(), allocations()]  # the workspace again: the first call fills it
        held = lifetime.workspace(g).nbytes()
        lifetime.clear_workspace(g)
        emptied = lifetime.workspace(g).nbytes()
        counts += [allocations(), allocations()]  # cleared: made once more, then reused
        return counts, held, emptied

    for counts, held, emptied in LocalWorld(world).run(rank):
        assert counts == [2, 2, 2, 0, 2, 0]
        assert held == 2 * 2 * 4 * 2 * 6 * 8 and emptied == 0  # 2 slots of K and V: 4 tokens, 2 heads, dim 6


def test_clear_workspace_without_a_communicator_clears_this_threads():
    comm = SingleRank()
    ws = lifetime.workspace(comm)  # a world of one keeps its workspace per thread
    ws.buffers(("kv", 1))[0] = [torch.zeros(3)]
    ws.ready = object()
    lifetime.clear_workspace()
    assert ws.nbytes() == 0 and ws.ready is None and lifetime.workspace(comm) is ws


def test_calls_of_two_dtypes_keep_their_own_slots():
    """Equal shapes, float32 then float64 then float32 on each rank: each dtype has its own workspace slots
    (a float64 call receiving into float32 slots would lose its precision)."""
    world = 3
    q, k, v, _ = inputs(world)
    want = sdpa_reference(q, k, v, True)

    def rank(g):
        cfg = RingConfig(g, CPUBackend(), True, 1 / math.sqrt(q.shape[-1]))
        outs = []
        for dtype in (torch.float32, torch.float64, torch.float32):
            ql, kl, vl = (xcp.shard(x.to(dtype), world, g.rank()) for x in (q, k, v))
            outs.append(ring_forward(ql, kl, vl, cfg)[0])
        return outs, len(lifetime.workspace(g)._sets)

    results = LocalWorld(world).run(rank)
    assert [r[1] for r in results] == [2] * world  # one set of KV slots per dtype
    for i, dtype in enumerate((torch.float32, torch.float64, torch.float32)):
        got = xcp.unshard([r[0][i] for r in results])
        assert got.dtype == dtype
        # float64: summation order only; float32: a few roundings of values of size ~1
        assert (got.double() - want).abs().max().item() < (1e-10 if dtype == torch.float64 else 1e-5)


def test_results_never_alias_the_workspace():
    world = 3
    q, k, v, do = inputs(world)

    def rank(g):
        ql, kl, vl, dl = (xcp.shard(x, world, g.rank()) for x in (q, k, v, do))
        cfg = RingConfig(g, CPUBackend(), True, 0.5)
        out, lse = ring_forward(ql, kl, vl, cfg)
        dq, dk, dv = ring_backward(dl, ql, kl, vl, out, lse, cfg)
        ws = lifetime.workspace(g)
        held = {t.untyped_storage().data_ptr() for s in ws._sets.values() for b in s.values() for t in b}
        mine = {t.untyped_storage().data_ptr() for t in (out, lse, dq, dk, dv)}
        return len(held), held & mine

    for n_held, shared in LocalWorld(world).run(rank):
        assert n_held == 4  # KV slots (2 x one buffer of K then V) and dKV slots (2 x one of dK then dV)
        assert not shared


def test_workspace_keeps_at_most_its_capacity():
    ws = Workspace(capacity=2)
    a = ws.buffers(("kv", 1))
    a[0] = [torch.zeros(3)]
    ws.buffers(("kv", 2))
    assert ws.buffers(("kv", 1)) is a  # a hit refreshes the key
    ws.buffers(("kv", 3))  # evicts ("kv", 2), the least recently used
    assert set(ws._sets) == {("kv", 1), ("kv", 3)}
    assert ws.nbytes() == 12
    ws.clear()
    assert ws.nbytes() == 0 and ws.ready is None


def test_a_rank_keeps_the_slots_of_its_four_latest_shapes():
    """docs/lifetime.md: the workspace keeps at most four keys, least recently used dropped first. After
    forward calls of five head dims on each rank, the four latest reuse their slots and the first, dropped,
    allocates again: the memory a rank holds between calls stays bounded, and a working set of four shapes
    allocates nothing."""
    world = 3
    dims = (2, 3, 4, 5, 6)

    def rank(g):
        cfg = RingConfig(g, CPUBackend(), True, 0.5)
        shards = {d: [xcp.shard(x, world, g.rank()) for x in inputs(world, dim=d)[:3]] for d in dims}

        def allocations(d):
            with track_buffers() as led:
                ring_forward(*shards[d], cfg)
            return led.allocations

        for d in dims:
            allocations(d)
        held = len(lifetime.workspace(g)._sets)
        return held, [allocations(d) for d in reversed(dims[1:])], allocations(dims[0])

    for held, reused, dropped in LocalWorld(world).run(rank):
        assert held == 4
        assert reused == [0, 0, 0, 0]
        assert dropped == 2  # the two KV slots of the first shape, made anew


@pytest.mark.parametrize("handoff", ["event", "none", "clone"])
def test_handoff_policies_keep_the_numbers(handoff):
    tensors, results = run_ring(3, handoff=handoff)
    check_numbers(tensors, results)
    for ledgers, _ in results:
        fwd, bwd = ledgers[0]
        assert fwd.peak_kv_shards == 2 and bwd.peak_kv_shards == 4
        kv_bytes = 2 * 4 * 2 * 6 * 8  # K and V of one rank: 4 tokens, 2 heads, dim 6, float64
        if handoff == "clone":  # one copy per channel alive at a time, counted in bytes, not in shards
            assert fwd.peak_bytes == 3 * kv_bytes
            assert bwd.peak_bytes == 6 * kv_bytes
            assert fwd.allocations == 2 + 2  # two slots, then a copy per send (steps 0 and 1)
        else:
            assert fwd.peak_bytes == 2 * kv_bytes
        assert fwd.live_bytes == 0 and bwd.live_bytes == 0


def test_attention_passes_the_handoff_override_through(monkeypatch):
    world = 3
    q, k, v, _ = inputs(world)
    seen = []
    real = lifetime.hand_off

    def spy(backend, tensor, consumer, policy):
        seen.append(policy)
        return real(backend, tensor, consumer, policy)

    def rank(g):
        ql, kl, vl = (xcp.shard(x, world, g.rank()) for x in (q, k, v))
        return ring_forward(ql, kl, vl, RingConfig(g, CPUBackend(), True, 0.5, handoff="clone"))[0]

    monkeypatch.setattr(lifetime, "hand_off", spy)  # where xcp.lifetime applies the hand-off policy
    LocalWorld(world).run(rank)
    assert seen and set(seen) == {"clone"}


def test_bad_policy_and_handoff_are_named():
    g = LocalWorld(2).group(0)
    with pytest.raises(ValueError, match="slots: expected one of bounded, keep_all; got 'tiny'"):
        RingCall(g, CPUBackend(), torch.device("cpu"), "tiny", None)
    with pytest.raises(ValueError, match="handoff: expected one of record_stream, clone, event, none; got 'copy'"):
        RingCall(g, CPUBackend(), torch.device("cpu"), "bounded", "copy")


class Tokens:
    """Distinct stream and event tokens, so a test can see which stream waited on which."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class RecordingBackend(CPUBackend):
    """A CPU backend whose streams are tokens and which logs every stream operation and hand-off."""

    def __init__(self):
        self.log = []
        self.capturing = False
        self.caller = Tokens("C")
        self._streams = 0

    def current_stream(self, device=None):
        return self.caller

    def new_stream(self, device=None):
        self._streams += 1
        return Tokens(f"S{self._streams}")

    def new_event(self):
        return Tokens("event")

    def record_event(self, event, stream):
        self.log.append(("record", stream.name))

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream.name))

    def wait_stream(self, stream, other):
        self.log.append(("wait_stream", stream.name, other.name))

    def is_capturing(self):
        return self.capturing

    def hand_off(self, tensor, policy):
        """Stands in for xcp.lifetime.hand_off (see :func:`recording`): logs the policy applied."""
        self.log.append(("handoff", policy))
        return tensor


@pytest.fixture
def recording(monkeypatch):
    """A RecordingBackend whose hand-offs (applied by xcp.lifetime over the backend's primitives) are logged."""
    be = RecordingBackend()
    monkeypatch.setattr(lifetime, "hand_off", lambda backend, tensor, consumer, policy: be.hand_off(tensor, policy))
    return be


def test_fork_first_and_join_last(recording):
    be = recording
    g = LocalWorld(1).group(0)
    call = RingCall(g, be, torch.device("cpu"), "bounded", None)
    with call:
        with call.on_comm():
            call.hand_to_comm([torch.zeros(2)], "kv")
    assert be.log[0] == ("wait_stream", "S1", "C")  # rule 1: M waits on C before anything else
    assert ("wait_stream", "C", "S1") in be.log[-2:]  # and C waits on M before the call returns
    assert be.log[1:4] == [("record", "C"), ("wait_event", "S1"), ("handoff", "none")]  # rule 3: ordered, then policy


def test_capture_takes_slots_from_the_workspace_and_never_record_stream(recording):
    be = recording
    g = LocalWorld(1).group(0)
    like = (torch.zeros(1, 4, 2, 3), torch.zeros(1, 4, 2, 3))
    be.capturing = True
    with pytest.raises(RuntimeError, match="run one call with the same shapes before capturing"):
        RingCall(g, be, torch.device("cpu"), "bounded", None).slots("kv", like)
    be.capturing = False
    warm = RingCall(g, be, torch.device("cpu"), "bounded", "record_stream")
    warm.slots("kv", like)
    with warm:
        pass
    be.capturing = True
    with track_buffers() as led:
        call = RingCall(g, be, torch.device("cpu"), "bounded", "record_stream")
        call.slots("kv", like)
        with call:
            call.hand_to_comm(list(like), "kv")
    assert led.allocations == 0 and led.peak_kv_shards == 2 and led.live_bytes == 0
    assert [e for e in be.log if e[0] == "handoff"][-2:] == [("handoff", "event")] * 2  # rule 4
    with pytest.raises(ValueError, match="'keep_all' allocates a buffer per step"):
        RingCall(g, be, torch.device("cpu"), "keep_all", None)


def test_local_world_names_a_shape_mismatch():
    world = LocalWorld(2, timeout=5)

    def rank(g):
        if g.rank() == 0:
            g.exchange([(torch.zeros(3), 1)], [], "kv", CPUBackend())
        else:
            g.exchange([], [(torch.zeros(4), 0)], "kv", CPUBackend()).wait()

    with pytest.raises(RuntimeError, match=r"sending kv0 shaped \(3,\).*expects \(4,\)"):
        world.run(rank)


def test_local_world_names_a_count_mismatch():
    """A rank that sends two tensors to a peer which posted one buffer is told so at once, not after a timeout."""
    world = LocalWorld(2, timeout=5)

    def rank(g):
        if g.rank() == 0:
            g.exchange([(torch.zeros(3), 1), (torch.zeros(3), 1)], [], "kv", CPUBackend())
        else:
            g.exchange([], [(torch.zeros(3), 0)], "kv", CPUBackend()).wait()

    with pytest.raises(RuntimeError, match="sending 2 kv tensors to rank 1, which posted 1 receive buffers"):
        world.run(rank)


def test_local_world_times_out_naming_the_missing_peer():
    world = LocalWorld(2, timeout=0.2)

    def rank(g):
        if g.rank() == 0:
            g.exchange([(torch.zeros(3), 1)], [], "kv", CPUBackend())

    with pytest.raises(RuntimeError, match="rank 0 waited 0.2 s for rank 1 to post receive kv0"):
        world.run(rank)
