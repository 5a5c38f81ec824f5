"""The hybrid all-to-all + ring (``ulysses=U``) on LocalWorld threads: float64 against the whole sequence.

P in {2, 4, 8} with every factorisation P = U x R, causal and not, every balance, GQA with fewer K/V heads
than U, packed documents, windows and sinks: output and gradients to 1e-10. Also the placement of
``shard(..., ulysses=U)`` and the round trip through ``unshard``, the all-to-all and LocalWorld sub-groups,
the named errors, and the all-to-all bytes per rank against a formula.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch
from helpers import independent_masked_reference, run_sharded
from strategies import random_inputs

import xcp
from xcp.comm import LocalGroup, hybrid_members
from xcp.hybrid import (
    heads_to_tokens,
    hybrid_backward,
    hybrid_config,
    hybrid_forward,
    hybrid_traffic,
    kv_replicas,
    tokens_to_heads,
)
from xcp.traffic import ring_traffic

FACTORISATIONS = [(p, u) for p in (2, 4, 8) for u in (1, 2, 4, 8) if p % u == 0]
TOL = 1e-10


def hybrid_run(q, k, v, dout, world, ulysses, causal, balance="zigzag", sinks=None, grads=(True, True, True), **kw):
    """Shard with ``ulysses``, run xcp.attention(ulysses=...) on a LocalWorld, backward with dout's shard,
    unshard; returns out, dq, dk, dv (None where no grad) and, with sinks, their gradient summed over ranks."""
    options = dict(balance=balance, ulysses=ulysses, sinks=sinks, grads=grads)
    return run_sharded(q, k, v, dout, world, causal=causal, timeout=30, **options, **kw)


def assert_close(name, got, want, tol=TOL):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.to(torch.float64) - want).abs().max().item()
    assert err <= tol, f"{name}: max abs error {err:.3e} > {tol:g}"


@pytest.mark.parametrize(("world", "ulysses"), FACTORISATIONS, ids=[f"P{p}-U{u}" for p, u in FACTORISATIONS])
def test_hybrid_matches_the_whole_sequence(reference, world, ulysses):
    """Every balance, causal and not, batch 2, 8 heads over 2 K/V heads (replicated when U is 4 or 8)."""
    for balance in xcp.BALANCES:
        for causal in (True, False):
            q, k, v, dout = random_inputs(2, 32, 8, 2, 4, seed=world * 10 + ulysses)
            got = hybrid_run(q, k, v, dout, world, ulysses, causal, balance)
            want = reference(q, k, v, dout, causal)
            for name, g in zip(("out", "dq", "dk", "dv"), got):
                assert_close(f"P={world} U={ulysses} {balance} causal={causal} {name}", g, want.tensors()[name])


@pytest.mark.parametrize(
    ("world", "ulysses", "heads", "kv_heads"),
    [(4, 4, 4, 1), (4, 4, 8, 2), (8, 8, 8, 1), (8, 4, 12, 3), (8, 4, 12, 6), (4, 2, 6, 3), (8, 2, 4, 1)],
)
def test_gqa_with_fewer_kv_heads_than_ulysses(reference, world, ulysses, heads, kv_heads):
    """K/V heads are replicated to the smallest count U divides and their gradients summed back; a scale."""
    replicas = kv_replicas(heads, kv_heads, ulysses)
    assert (kv_heads * replicas) % ulysses == 0 and heads % (kv_heads * replicas) == 0
    q, k, v, dout = random_inputs(1, 2 * world, heads, kv_heads, 4, seed=heads + kv_heads)
    got = hybrid_run(q, k, v, dout, world, ulysses, True, "zigzag", scale=0.3)
    want = reference(q, k, v, dout, True, scale=0.3)
    for name, g in zip(("out", "dq", "dk", "dv"), got):
        assert_close(name, g, want.tensors()[name])


DOCS = [(0, 32), (0, 5, 6, 19, 32), (0, 1, 2, 30, 32), (0, 16, 17, 32)]


@pytest.mark.parametrize(
    ("world", "ulysses"), [(2, 2), (4, 2), (8, 2), (8, 4)], ids=["P2-U2", "P4-U2", "P8-U2", "P8-U4"]
)
def test_documents_window_and_sinks(world, ulysses):
    """Global cu_seqlens and windows pass unchanged to the ring over R ranks; sinks are sliced per head
    group and their gradient, summed over ranks, is the whole sequence's."""
    case = 0
    for balance in xcp.BALANCES:
        for causal in (True, False):
            for window in (None, (3, 0) if causal else (4, 2), (9, None) if causal else (None, 5)):
                cu = DOCS[case % len(DOCS)]
                with_sinks = case % 2 == 0
                case += 1
                gen = torch.Generator().manual_seed(case)
                q, dout = (torch.randn(1, 32, 4, 4, generator=gen, dtype=torch.float64) for _ in range(2))
                k, v = (torch.randn(1, 32, 1 + case % 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
                sinks = torch.randn(4, generator=gen, dtype=torch.float64) if with_sinks else None
                cu_arg = None if len(cu) == 2 and case % 3 == 0 else torch.tensor(cu)
                got = hybrid_run(
                    q, k, v, dout, world, ulysses, causal, balance, sinks, cu_seqlens=cu_arg, window=window
                )
                want = independent_masked_reference(q, k, v, dout, cu, causal, sinks, window=window)
                what = f"{balance} causal={causal} cu={cu} window={window} sinks={with_sinks}"
                for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
                    assert_close(f"{what} {name}", g, w)


def test_no_grad_and_partial_grads_match(reference):
    """Without autograd the same output; with only q requiring grad, dq alone (k and v get None)."""
    q, k, v, dout = random_inputs(1, 16, 4, 2, 4, seed=3)
    want = reference(q, k, v, dout, True)

    def rank_fn(group):
        r = group.rank()
        local = [xcp.shard(t, 4, r, ulysses=2) for t in (q, k, v)]
        with torch.no_grad():
            plain = xcp.attention(*local, causal=True, group=group, ulysses=2)
        return plain

    out = xcp.unshard(xcp.LocalWorld(4).run(rank_fn), ulysses=2)
    assert_close("out (no grad)", out, want.out)
    got = hybrid_run(q, k, v, dout, 4, 2, True, grads=(True, False, False))
    assert got[2] is None and got[3] is None
    assert_close("dq", got[1], want.dq)


@pytest.mark.parametrize(
    ("world", "ulysses", "kv_heads", "cu", "with_sinks"),
    [(4, 2, 2, None, False), (4, 4, 1, (0, 5, 32), True), (8, 2, 1, None, True), (8, 8, 2, (0, 9, 32), False)],
)
def test_hybrid_forward_and_backward_without_autograd(world, ulysses, kv_heads, cu, with_sinks):
    """The plain functions virtual ranks on a GPU drive (xcp run, xcp bench): hybrid_forward then
    hybrid_backward give the whole sequence's out, dq, dk, dv (K/V replicas summed back, sinks sliced per head
    group, documents passed to the ring), with no autograd graph."""
    gen = torch.Generator().manual_seed(world + ulysses)
    q, dout = (torch.randn(1, 32, 8, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 32, kv_heads, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(8, generator=gen, dtype=torch.float64) if with_sinks else None
    be = xcp.get_backend("cpu")

    def rank_fn(group):
        r = group.rank()
        ql, kl, vl, dl = (xcp.shard(t, world, r, ulysses=ulysses) for t in (q, k, v, dout))
        cfg = hybrid_config(ql, kl, group, be, ulysses, causal=True, scale=0.5, cu_seqlens=cu, sinks=sinks)
        assert cfg.replicas == kv_replicas(8, kv_heads, ulysses) and cfg.head.size() == ulysses
        out, state = hybrid_forward(ql, kl, vl, cfg, sinks)
        assert not out.requires_grad and state.q.shape == (1, 32 * ulysses // world, 8 // ulysses, 4)
        return (out, *hybrid_backward(dl, state, cfg))

    per_rank = xcp.LocalWorld(world).run(rank_fn)
    got = [xcp.unshard([res[i] for res in per_rank], ulysses=ulysses) for i in range(4)]
    want = independent_masked_reference(q, k, v, dout, cu or (0, 32), True, sinks, scale=0.5)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, g, w)


def test_hybrid_traffic_is_the_formula():
    """Per tensor and step, against the counts written out: P = 8 = 4 x 2, 8 heads over 2 K/V heads (not
    replicated), float32 (dK/dV in float32 too)."""
    t = hybrid_traffic(2, 64, 8, 2, 16, torch.float32, 8, 4)
    n, item = 64 // 8, 4
    assert (t.ring, t.ring_steps) == (2, 2)
    assert t.q == 3 * 2 * n * 8 * 16 * item // 4 and t.kv == 3 * 2 * n * 4 * 16 * item // 4  # lcm(2, 4) = 4
    assert t.kv_shard == t.dkv_message == 2 * 2 * 32 * 1 * 16 * item  # S/R = 32 tokens, 4/4 = 1 K/V head
    assert t.forward == 2 * t.q + 2 * t.kv + t.kv_shard
    assert t.backward == 2 * t.q + 2 * t.kv + t.kv_shard + 2 * t.dkv_message
    assert t.forward_alltoall == t.backward_alltoall == 2 * t.q + 2 * t.kv  # q, k, v in and out back
    flat = hybrid_traffic(1, 64, 8, 2, 16, torch.bfloat16, 8, 1)
    assert flat.forward_alltoall == 0 and flat.forward == 7 * flat.kv_shard and flat.dkv_message == 2 * flat.kv_shard
    ring = ring_traffic(64, 8, 8, 2, 16, torch.bfloat16)  # U = 1: the ring alone, as the tools count it
    assert flat.ring_part == ring and (flat.forward, flat.backward) == (ring.forward, ring.backward)
    assert ring.kv_shard == 2 * 8 * 2 * 16 * 2 and ring.backward == 7 * ring.kv_shard + 8 * ring.dkv_message
    alone = hybrid_traffic(1, 64, 8, 2, 16, torch.float64, 8, 8)  # a ring of one rank moves nothing
    assert alone.forward_ring == alone.backward_ring_kv == alone.backward_ring_dkv == 0 and alone.total > 0
    with pytest.raises(ValueError, match="ulysses: expected a divisor of the world size 8"):
        hybrid_traffic(1, 64, 8, 2, 16, torch.float32, 8, 3)
    with pytest.raises(ValueError, match="ulysses: expected a divisor of the 6 heads of q"):
        hybrid_traffic(1, 64, 6, 2, 16, torch.float32, 8, 4)


# ---------------------------------------------------------------------------------------------- placement


@pytest.mark.parametrize(("world", "ulysses"), FACTORISATIONS)
def test_shard_places_pieces_of_ring_shards_and_unshard_inverts_it(world, ulysses):
    x = torch.arange(2 * 48 * 3, dtype=torch.float64).view(2, 48, 3)
    rings = world // ulysses
    for balance in xcp.BALANCES:
        for dim in (1, -2):
            shards = [xcp.shard(x, world, r, dim=dim, balance=balance, ulysses=ulysses) for r in range(world)]
            assert torch.equal(xcp.unshard(shards, dim=dim, balance=balance, ulysses=ulysses), x)
            for r, s in enumerate(shards):
                ring_shard = xcp.shard(x, rings, r // ulysses, balance=balance)
                n = ring_shard.shape[1] // ulysses
                assert torch.equal(s, ring_shard[:, (r % ulysses) * n : (r % ulysses + 1) * n])
                assert s.is_contiguous() and s.data_ptr() != x.data_ptr()
    if ulysses == 1:
        assert all(torch.equal(xcp.shard(x, world, r, ulysses=1), xcp.shard(x, world, r)) for r in range(world))


@pytest.mark.parametrize(("world", "ulysses"), [(4, 2), (8, 4), (4, 4), (8, 2)])
def test_the_all_to_all_gathers_the_ring_shard_and_inverts(world, ulysses):
    """heads_to_tokens on the shards of a head group gives the ring shard of its ring position with this
    rank's head slice, for every balance; tokens_to_heads gives the shard back exactly."""
    x = torch.randn(2, 8 * world, 8, 3, dtype=torch.float64)
    heads = 8 // ulysses

    def rank_fn(group, balance):
        r = group.rank()
        head, ring = group.hybrid_groups(ulysses)
        assert (head.rank(), head.size(), ring.rank(), ring.size()) == (
            r % ulysses,
            ulysses,
            r // ulysses,
            world // ulysses,
        )
        mine = xcp.shard(x, world, r, balance=balance, ulysses=ulysses)
        (gathered,) = heads_to_tokens(head, xcp.get_backend("cpu"), [mine])
        want = xcp.shard(x, world // ulysses, r // ulysses, balance=balance)[:, :, (r % ulysses) * heads :][
            :, :, :heads
        ]
        assert torch.equal(gathered, want)
        (back,) = tokens_to_heads(head, xcp.get_backend("cpu"), [gathered])
        assert torch.equal(back, mine)
        return True

    for balance in xcp.BALANCES:
        assert all(xcp.LocalWorld(world).run(rank_fn, balance))


def test_local_subgroups_and_all_to_all():
    """Sub-groups of a LocalWorld: ranks and members, exchange and all_to_all with peers as group ranks,
    their own agreed set but the rank's streams and workspace."""
    be = xcp.get_backend("cpu")

    def rank_fn(group):
        r = group.rank()
        assert hybrid_members(6, r, 3) == ([r // 3 * 3 + j for j in range(3)], [r % 3, r % 3 + 3])
        sub = group.subgroup([5, 3, 1] if r % 2 else [0, 2, 4])
        me = sub.rank()
        assert sub.members == ((5, 3, 1) if r % 2 else (0, 2, 4)) and sub.members[me] == r
        send = torch.tensor([[100 * r + j] for j in range(3)], dtype=torch.float64)
        recv = torch.empty_like(send)
        sub.all_to_all(send, recv, "a2a", be).wait()
        assert recv[:, 0].tolist() == [100 * m + me for m in sub.members]
        buf = torch.empty(1)
        sub.exchange([(torch.tensor([float(r)]), (me + 1) % 3)], [(buf, (me - 1) % 3)], "kv", be).wait()
        assert buf.item() == sub.members[(me - 1) % 3]
        store, own = group.rank_store(), sub.rank_store()
        assert own is not store and own["workspace"] is store["workspace"] and own["streams"] is store["streams"]
        return True

    assert all(xcp.LocalWorld(6).run(rank_fn))
    group = xcp.LocalWorld(4).group(1)
    with pytest.raises(ValueError, match="includes this rank 1"):
        group.subgroup([0, 2])
    with pytest.raises(ValueError, match="distinct ranks in"):
        group.subgroup([1, 1, 5])
    with pytest.raises(ValueError, match="send: expected dim 0 of size 4"):
        group.all_to_all(torch.zeros(3), torch.zeros(3), "a2a", xcp.get_backend("cpu"))


# ---------------------------------------------------------------------------------------------- errors


def test_named_errors_of_ulysses():
    x = torch.zeros(1, 24, 4, 2)
    for bad, kind in ((0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError), ("2", TypeError)):
        with pytest.raises(kind, match="ulysses: expected a positive integer"):
            xcp.shard(x, 4, 0, ulysses=bad)
        with pytest.raises(kind, match="ulysses: expected a positive integer"):
            xcp.unshard([x, x], ulysses=bad)
        with pytest.raises(kind, match="ulysses: expected a positive integer"):
            xcp.attention(x, x, x, ulysses=bad)
    with pytest.raises(ValueError, match="ulysses: expected a divisor of world_size 6 .*got 4"):
        xcp.shard(x, 6, 0, ulysses=4)
    with pytest.raises(ValueError, match="ulysses: expected a divisor of the 3 shards"):
        xcp.unshard([x, x, x], ulysses=2)
    with pytest.raises(ValueError, match=r"x.shape\[1\]: expected a multiple of world_size 8 with ulysses=2"):
        xcp.shard(torch.zeros(1, 20, 2, 2), 8, 0, balance="contiguous", ulysses=2)  # 4 rings of 5: not 2 pieces
    with pytest.raises(ValueError, match="ulysses: expected a divisor of the group's size 1"):
        xcp.attention(x, x, x, ulysses=2)  # no group: a world of one


def test_ulysses_not_dividing_the_heads_or_the_group_is_named_on_every_rank():
    def rank_fn(group, heads, ulysses):
        x = torch.zeros(1, 8, heads, 2)
        return xcp.attention(x, x, x, group=group, ulysses=ulysses)

    with pytest.raises(RuntimeError, match="ulysses: expected a divisor of the 6 heads of q .*got 4"):
        xcp.LocalWorld(4).run(rank_fn, 6, 4)
    with pytest.raises(RuntimeError, match="ulysses: expected a divisor of the group's size 4 .*got 3"):
        xcp.LocalWorld(4).run(rank_fn, 6, 3)


def test_ranks_that_disagree_on_ulysses_all_raise():
    """The first call's agreement check runs on the whole group with the shapes the ring will see, which
    differ for every U: every rank raises the same error naming q.shape, and nobody waits forever."""

    def rank_fn(group):
        x = torch.zeros(1, 8, 4, 2)
        try:
            xcp.attention(x, x, x, group=group, ulysses=2 if group.rank() < 2 else 4, causal=True)
        except ValueError as exc:
            return str(exc)
        return None

    messages = xcp.LocalWorld(4, timeout=10).run(rank_fn)
    assert all(m is not None and m == messages[0] for m in messages)
    assert "q.shape (ranks 0, 1: (1, 16, 2, 2); ranks 2, 3: (1, 32, 1, 2))" in messages[0]
    assert "ulysses (ranks 0, 1: 2; ranks 2, 3: 4)" in messages[0]


@pytest.mark.parametrize("other", [1, 4])
def test_ranks_that_disagree_on_ulysses_with_shapes_that_hide_it_all_raise(other):
    """ulysses is a field of the agreement: ranks 0, 1 with 8 tokens of 4 heads and U = 2, ranks 2, 3 with 4
    tokens of 8 heads and U = 4 show the ring the same shapes [1, 16, 2, 2] (with U = 1 ranks 2, 3 run the
    flat ring, whose check meets the hybrid's on the whole group). Without the field the first pair would
    pass the check and wait for all-to-all peers that never come."""

    def rank_fn(group):
        x = torch.zeros(1, 8, 4, 2) if group.rank() < 2 else torch.zeros(1, 4, 8, 2)
        try:
            xcp.attention(x, x, x, group=group, ulysses=2 if group.rank() < 2 else other, causal=True)
        except ValueError as exc:
            return str(exc)
        return None

    messages = xcp.LocalWorld(4, timeout=10).run(rank_fn)
    assert all(m is not None and m == messages[0] for m in messages)
    assert f"ulysses (ranks 0, 1: 2; ranks 2, 3: {other})" in messages[0]


def test_ulysses_between_shard_and_attention_is_not_checked():
    """Shards carry no record of how they were made: a shard(ulysses=2) passed to attention(ulysses=1)
    runs, and gives the attention of a permuted sequence (documented in docs/design.md)."""
    q, k, v, dout = random_inputs(1, 16, 4, 2, 4, seed=5)

    def rank_fn(group):
        local = [xcp.shard(t, 4, group.rank(), ulysses=2) for t in (q, k, v)]
        return xcp.attention(*local, causal=True, group=group)

    out = xcp.unshard(xcp.LocalWorld(4).run(rank_fn), ulysses=2)
    right = hybrid_run(q, k, v, dout, 4, 2, True)[0]
    assert not torch.allclose(out, right)


def test_a_communicator_that_cannot_split_is_named():
    class Wrapped:
        ranks_are_threads = True

        def __init__(self, inner: LocalGroup) -> None:
            self.inner = inner

        def rank(self):
            return self.inner.rank()

        def size(self):
            return self.inner.size()

        def rank_store(self):
            return self.inner.rank_store()

        def exchange(self, *args, **kwargs):
            return self.inner.exchange(*args, **kwargs)

    def rank_fn(group):
        x = torch.zeros(1, 4, 2, 2)
        return xcp.attention(x, x, x, group=Wrapped(group), ulysses=2)

    with pytest.raises(RuntimeError, match="group: ulysses > 1 needs a group xcp can split .* got Wrapped"):
        xcp.LocalWorld(2).run(rank_fn)


# ---------------------------------------------------------------------------------------------- bytes


@pytest.mark.parametrize(
    ("world", "ulysses", "heads", "kv_heads", "dtype"),
    [
        (4, 2, 4, 2, torch.float64),
        (8, 4, 8, 1, torch.float32),
        (8, 8, 8, 2, torch.float64),
        (4, 4, 4, 4, torch.float32),
    ],
)
def test_all_to_all_bytes_per_rank_match_the_formula(world, ulysses, heads, kv_heads, dtype):
    """What each rank sends to the other ranks of its head group (counted at the LocalWorld exchange)
    equals hybrid_traffic's forward_alltoall in the forward and again in the backward."""
    batch, seq, dim = 2, 4 * world, 4
    q, k, v, dout = random_inputs(batch, seq, heads, kv_heads, dim, dtype=dtype, seed=7)
    counted: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    exchange = LocalGroup.exchange

    def counting(self, sends, recvs, tag, backend, step=None):
        if tag == "a2a":
            with lock:
                counted[threading.current_thread().name] += sum(t.numel() * t.element_size() for t, _ in sends)
        return exchange(self, sends, recvs, tag, backend, step)

    def rank_fn(group):
        r = group.rank()
        local = [xcp.shard(t, world, r, ulysses=ulysses).requires_grad_() for t in (q, k, v)]
        out = xcp.attention(*local, causal=True, group=group, ulysses=ulysses)
        forward = counted[threading.current_thread().name]
        out.backward(xcp.shard(dout, world, r, ulysses=ulysses))
        return forward, counted[threading.current_thread().name] - forward

    LocalGroup.exchange = counting
    try:
        per_rank = xcp.LocalWorld(world).run(rank_fn)
    finally:
        LocalGroup.exchange = exchange
    want = hybrid_traffic(batch, seq, heads, kv_heads, dim, dtype, world, ulysses).forward_alltoall
    assert want > 0
    assert per_rank == [(want, want)] * world


# ---------------------------------------------------------------------------------------------- lifetimes


@pytest.mark.parametrize(
    ("world", "ulysses", "kv_heads", "causal", "cu", "with_sinks"),
    [(4, 2, 1, True, None, False), (4, 4, 2, False, (0, 7, 32), True), (8, 2, 2, True, (0, 20, 32), False)],
)
def test_the_sanitizer_finds_no_race_reuse_or_leak_in_the_hybrid(world, ulysses, kv_heads, causal, cu, with_sinks):
    """The hybrid on the simulated asynchronous device (xcp.testing.sanitizer), forward and backward: the
    all-to-all buffers are made, written and read on the caller's stream in order (the own piece is
    copied before the receives are posted), nothing stays alive, and the numbers are right.

    With U >= 3, two peers write their (disjoint) rows of one receive buffer on their own streams,
    unordered with each other, as any all-to-all does; the model tracks whole storages and reports such a
    pair (docs/lifetime.md, Limits), so exactly those pairs are set aside here."""
    from xcp.testing.sanitizer import Sanitizer

    gen = torch.Generator().manual_seed(world + ulysses)
    q, dout = (torch.randn(1, 32, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 32, kv_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) if with_sinks else None
    with Sanitizer() as san:

        def rank_fn(group):
            r = group.rank()
            local = [xcp.shard(x, world, r, ulysses=ulysses).requires_grad_() for x in (q, k, v)]
            with san.thread(f"rank{r}"):
                cu_arg = None if cu is None else torch.tensor(cu)
                out = xcp.attention(*local, causal=causal, group=group, device="sim", ulysses=ulysses,
                                    cu_seqlens=cu_arg, sinks=sinks)  # fmt: skip
                out.backward(xcp.shard(dout, world, r, ulysses=ulysses))
            return [out.detach(), *(t.grad for t in local)]

        lw = xcp.LocalWorld(world)
        per_rank = lw.run(rank_fn)
        lw.release_buffers()
        got = [xcp.unshard([res[i] for res in per_rank], ulysses=ulysses).tolist() for i in range(4)]
        del per_rank  # the results are buffers the model allocated: dropped before the leak check

    def peers_rows(finding) -> bool:  # two different senders' copies into one receive buffer
        ops = [a.op for a in finding.accesses]
        return finding.kind == "race" and all("(p2p a2a" in op for op in ops) and len(set(ops)) == len(ops)

    assert [f for f in san.findings if not peers_rows(f)] == [] and san.leaks() == []
    assert ulysses >= 3 or san.findings == []
    want = independent_masked_reference(q, k, v, dout, cu or (0, 32), causal, sinks)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, torch.tensor(g, dtype=torch.float64), w)
