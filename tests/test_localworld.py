"""xcp.LocalWorld: virtual ranks as threads. Results come back in rank order; a failing or missing rank
is reported by rank and never leaves the others hanging."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch
from strategies import random_inputs

import xcp
from xcp.comm import CommTimeout, RankAborted


def test_run_returns_results_in_rank_order():
    world = xcp.LocalWorld(5)

    def rank_fn(group, base):
        time.sleep(0.01 * (5 - group.rank()))  # finish in reverse order
        return base + group.rank(), group.size(), threading.current_thread().name

    results = world.run(rank_fn, 100)
    assert [r[0] for r in results] == [100, 101, 102, 103, 104]
    assert all(r[1] == 5 for r in results)
    assert [r[2] for r in results] == [f"xcp-rank-{r}" for r in range(5)]
    assert len({r[2] for r in results}) == 5, "each rank runs in its own thread"


def test_a_world_can_run_several_times():
    world = xcp.LocalWorld(3)
    q, k, v, _ = random_inputs(1, 12, 2, 1, 4, seed=1)

    def rank_fn(group):
        local = [xcp.shard(x, 3, group.rank()) for x in (q, k, v)]
        return xcp.attention(*local, causal=True, group=group)

    first, second = world.run(rank_fn), world.run(rank_fn)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_an_exception_in_one_rank_names_it_and_releases_the_others():
    """Rank 1 fails before sending; ranks 0 and 2 wait for it in the ring and must be aborted, not hang."""
    q, k, v, _ = random_inputs(1, 12, 2, 1, 4, seed=2)
    outcome: dict[int, str] = {}

    def rank_fn(group):
        if group.rank() == 1:
            raise KeyError("boom in rank 1")
        local = [xcp.shard(x, 3, group.rank()) for x in (q, k, v)]
        try:
            return xcp.attention(*local, causal=True, group=group)
        except BaseException as exc:
            outcome[group.rank()] = type(exc).__name__
            raise

    world = xcp.LocalWorld(3, timeout=60)  # far above the time allowed below: release must be by abort
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"LocalWorld rank 1 of 3 failed: KeyError: 'boom in rank 1'") as info:
        world.run(rank_fn)
    assert time.monotonic() - start < 10
    assert isinstance(info.value.__cause__, KeyError)
    assert outcome == {0: RankAborted.__name__, 2: RankAborted.__name__}


def test_a_failed_run_leaves_nothing_behind_and_its_world_is_collected():
    """The tensors (and autograd graph) of a failed run are freed once the caller lets go of the error, by
    reference counting alone; a world dropped after a failed run is collected like any (its mailboxes call
    back into it: a cycle, for the collector) and its rank threads end."""
    q, k, v, _ = random_inputs(1, 12, 2, 1, 4, seed=4)
    alive: dict[int, weakref.ref] = {}

    def rank_fn(group):
        local = [xcp.shard(x, 3, group.rank()).requires_grad_() for x in (q, k, v)]
        out = xcp.attention(*local, causal=True, group=group)
        alive[group.rank()] = weakref.ref(out)  # holds the autograd graph and the shards
        if group.rank() == 1:
            raise ValueError("boom after the forward")
        return out.sum()  # the other ranks return; rank 1's failure drops their results

    world = xcp.LocalWorld(3)
    threads = world.run(lambda g: threading.current_thread())
    gc.disable()  # what is freed below is freed by reference counting, not by a collection
    try:
        with pytest.raises(RuntimeError, match="rank 1 of 3 failed: ValueError: boom after the forward"):
            world.run(rank_fn)
        assert sorted(alive) == [0, 1, 2]
        assert [r for r, ref in alive.items() if ref() is not None] == []
    finally:
        gc.enable()
    world_ref = weakref.ref(world)
    del world
    gc.collect()
    assert world_ref() is None
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)  # the collected world ended its rank threads


def test_a_group_used_outside_run_is_refused_at_once():
    world = xcp.LocalWorld(2, timeout=60)  # far above the time allowed below: the refusal must be immediate
    q, k, v, _ = random_inputs(1, 8, 2, 1, 4, seed=5)
    local = [xcp.shard(x, 2, 0) for x in (q, k, v)]
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"group <LocalGroup rank 0 of 2>: expected a call inside LocalWorld.run\(fn\) on this rank's own "
        r"thread .*; got one from thread 'MainThread' outside any run",
    ):
        xcp.attention(*local, causal=True, group=world.group(0))
    assert time.monotonic() - start < 5

    def wrong_rank(group):  # rank 1's thread using rank 0's group
        return xcp.attention(*local, causal=True, group=world.group(0)) if group.rank() == 1 else None

    with pytest.raises(RuntimeError, match=r"got one from thread 'xcp-rank-1', which runs world rank 1"):
        world.run(wrong_rank)
    assert time.monotonic() - start < 5
    out = xcp.LocalWorld(1).group(0)  # a world of one has no peer to wait for: fine anywhere
    assert torch.equal(xcp.attention(q, k, v, causal=True, group=out), xcp.attention(q, k, v, causal=True))


def test_a_rank_that_never_sends_makes_its_peer_time_out():
    q, k, v, _ = random_inputs(1, 8, 2, 1, 4, seed=3)

    def rank_fn(group):
        if group.rank() == 1:
            return "gone"  # returns without taking part in the ring
        local = [xcp.shard(x, 2, group.rank()) for x in (q, k, v)]
        return xcp.attention(*local, group=group)

    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"LocalWorld rank 0 of 2 failed: CommTimeout: rank 0 waited 1 s for rank 1"
    ) as info:
        xcp.LocalWorld(2, timeout=1).run(rank_fn)
    assert 0.9 < time.monotonic() - start < 10
    assert isinstance(info.value.__cause__, CommTimeout)


def test_a_world_of_one():
    assert xcp.LocalWorld(1).run(lambda group: (group.rank(), group.size())) == [(0, 1)]


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2", None])
def test_bad_size(size):
    with pytest.raises(ValueError, match=rf"world_size: expected an integer >= 1; got {size!r}"):
        xcp.LocalWorld(size)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "1", None, True])
def test_bad_timeout(timeout):
    with pytest.raises(ValueError, match=r"timeout: expected a positive finite number of seconds.*; got "):
        xcp.LocalWorld(2, timeout=timeout)


@pytest.mark.parametrize("rank", [2, -1, "0"])
def test_bad_group_rank(rank):
    with pytest.raises(ValueError, match=rf"rank: expected an integer in \[0, 2\); got {rank!r}"):
        xcp.LocalWorld(2).group(rank)


def test_group_describes_itself():
    world = xcp.LocalWorld(3)
    assert repr(world) == "LocalWorld(world_size=3, device='cpu')"
    g = world.group(2)
    assert (g.rank(), g.size()) == (2, 3)
    assert repr(g) == "<LocalGroup rank 2 of 3>"


def test_a_rank_stuck_in_user_code_is_named_within_the_timeout():
    """run() returns within about the world's timeout when one rank never finishes, naming that rank."""
    release = threading.Event()

    def rank_fn(group):
        if group.rank() == 1:
            release.wait(30)  # stuck in user code: no xcp wait can time out here
        return group.rank()

    start = time.monotonic()
    try:
        expected = r"LocalWorld rank 1 of 3 did not finish within 0.6 s \(twice the world's"
        with pytest.raises(RuntimeError, match=expected):
            xcp.LocalWorld(3, timeout=0.3).run(rank_fn)
        assert time.monotonic() - start < 5
    finally:
        release.set()


def test_a_stuck_rank_after_a_failure_names_both():
    release = threading.Event()

    def rank_fn(group):
        if group.rank() == 0:
            raise ValueError("boom")
        release.wait(30)

    try:
        with pytest.raises(RuntimeError, match=r"rank 1 of 2 did not finish.*rank 0 had failed: ValueError: boom"):
            xcp.LocalWorld(2, timeout=0.3).run(rank_fn)
    finally:
        release.set()


# ---------------------------------------------------------------------------------------------- threads and turns
def test_ranks_keep_their_threads_from_run_to_run_and_a_stuck_one_is_replaced():
    world = xcp.LocalWorld(3, timeout=0.3)
    first = world.run(lambda g: threading.get_ident())
    assert world.run(lambda g: threading.get_ident()) == first  # per-thread caches survive between runs
    release = threading.Event()

    def stuck_rank_1(group):
        if group.rank() == 1:
            release.wait(5)  # stuck outside any xcp wait
        return threading.get_ident()

    with pytest.raises(RuntimeError, match="rank 1 of 3 did not finish"):
        world.run(stuck_rank_1)
    again = world.run(lambda g: threading.get_ident())
    assert again[0] == first[0] and again[2] == first[2] and again[1] != first[1]  # rank 1 got a new thread
    release.set()


def test_a_world_closes_with_its_context_and_then_refuses_to_run():
    before = set(threading.enumerate())
    with xcp.LocalWorld(3) as world:
        threads = world.run(lambda g: threading.current_thread())
        assert not world.closed and all(t.is_alive() for t in threads)
    assert world.closed
    assert not any(t.is_alive() for t in threads)  # close joined the idle rank threads
    assert set(threading.enumerate()) <= before  # the thread count is back where it was
    with pytest.raises(RuntimeError, match=r"LocalWorld.run: expected an open world; got one closed by close\(\)"):
        world.run(lambda g: None)
    world.close()  # closing twice is fine


def test_close_leaves_a_rank_stuck_in_user_code_behind_as_a_daemon_until_it_returns():
    """A stuck rank's thread cannot be stopped from outside: close joins the others, and the stuck one (also
    one replaced by a new thread for the next run) ends when its job returns."""
    release = threading.Event()
    seen: dict[int, threading.Thread] = {}

    def rank_fn(group, stuck_rank):
        seen.setdefault(group.rank(), threading.current_thread())
        if group.rank() == stuck_rank:
            release.wait(10)

    world = xcp.LocalWorld(2, timeout=0.1)
    before = set(threading.enumerate())
    try:
        with pytest.raises(RuntimeError, match="rank 1 of 2 did not finish"):
            world.run(rank_fn, 1)
        stuck = seen.pop(1)
        world.run(rank_fn, None)  # rank 1 runs on a new thread
        world.close()
        assert not seen[0].is_alive() and not seen[1].is_alive()
        assert stuck.is_alive() and stuck.daemon
    finally:
        release.set()
    stuck.join(5)
    assert not stuck.is_alive()
    assert set(threading.enumerate()) <= before


@pytest.mark.parametrize("cooperative", [False, True])
def test_cooperative_ranks_take_turns_and_compute_the_same(cooperative):
    """In a cooperative world one rank runs at a time (a kernel that dawdles never overlaps another rank's);
    the ring's result and gradients equal a free-running world's."""
    world = xcp.LocalWorld(3, cooperative=cooperative)
    assert world.cooperative is cooperative
    q, k, v, dout = random_inputs(1, 24, 2, 1, 4, seed=3)
    running, most = [0], [0]
    lock = threading.Lock()

    def rank_fn(group):
        local = [xcp.shard(x, 3, group.rank()).requires_grad_() for x in (q, k, v)]
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)  # user work between waits: a free-running world overlaps it, a cooperative one cannot
        with lock:
            running[0] -= 1
        out = xcp.attention(*local, causal=True, group=group)
        out.backward(xcp.shard(dout, 3, group.rank()))
        return out.detach(), *(x.grad for x in local)

    got = world.run(rank_fn)
    overlap = most[0]
    want = xcp.LocalWorld(3, cooperative=False).run(rank_fn) if cooperative else got
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    if cooperative:
        assert overlap == 1
    assert xcp.LocalWorld(2, device="cpu").cooperative is False  # CPU ranks compute: they run free


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux's per-thread CPU affinity")
def test_a_cooperative_world_runs_its_ranks_on_one_cpu_and_a_free_one_leaves_them():
    """Ranks that take turns share one CPU (pinned once, when their threads start); free-running ranks, or a
    world made with pin=False, keep the process's CPUs."""
    allowed = os.sched_getaffinity(0)

    def where(group):
        return os.sched_getaffinity(0)

    pinned = xcp.LocalWorld(3, cooperative=True).run(where)
    assert all(len(cpus) == 1 and cpus <= allowed for cpus in pinned) and len(set(map(frozenset, pinned))) == 1
    assert xcp.LocalWorld(3, cooperative=True, pin=False).run(where) == [allowed] * 3
    assert xcp.LocalWorld(3, cooperative=False).run(where) == [allowed] * 3
    assert os.sched_getaffinity(0) == allowed  # the caller's thread is left alone


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux's per-thread CPU affinity")
def test_the_pinned_cpu_falls_back_to_an_allowed_one(monkeypatch):
    """Without libc's sched_getcpu (or with an answer outside the process's CPUs) the ranks go to the lowest
    allowed CPU; a CPU taken away before the thread starts leaves the rank unpinned, not failed."""
    import ctypes

    from xcp.comm.threads import current_cpu

    def no_libc(*args, **kwargs):
        raise OSError("no libc here")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert current_cpu() == min(os.sched_getaffinity(0))
    world = xcp.LocalWorld(2, cooperative=True)
    world._cpu = 10**6  # not a CPU of this machine: sched_setaffinity raises, the rank runs unpinned
    assert world.run(lambda g: os.sched_getaffinity(0)) == [os.sched_getaffinity(0)] * 2


def test_a_rank_that_keeps_the_turn_makes_its_peer_time_out():
    world = xcp.LocalWorld(2, timeout=0.3, cooperative=True)
    x = torch.zeros(3)

    def rank_fn(group):
        if group.rank() == 0:
            time.sleep(1.0)  # holds the turn if it has it; either way rank 1 cannot proceed in time
            return None
        work = group.exchange([(x, 0)], [], "kv", xcp.get_backend("cpu"))
        work.wait()
        return None

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"CommTimeout: rank 1 waited 0\.3 s for") as info:
        world.run(rank_fn)
    assert time.monotonic() - start < 3.0
    assert "its turn to run" in str(info.value) or "rank 0 to post receive kv0" in str(info.value)


def test_the_hybrid_in_a_cooperative_world_equals_a_free_running_one():
    """The all-to-alls of the hybrid (several peers per exchange) hand the turn over like the ring's P2P."""
    q, k, v, dout = random_inputs(1, 32, 4, 2, 8, seed=7)

    def rank_fn(group):
        local = [xcp.shard(x, 4, group.rank(), ulysses=2).requires_grad_() for x in (q, k, v)]
        out = xcp.attention(*local, causal=True, group=group, ulysses=2)
        out.backward(xcp.shard(dout, 4, group.rank(), ulysses=2))
        return out.detach(), *(x.grad for x in local)

    coop = xcp.LocalWorld(4, cooperative=True).run(rank_fn)
    free = xcp.LocalWorld(4, cooperative=False).run(rank_fn)
    for a, b in zip(coop, free):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_thread_outside_the_turns_waits_for_a_cooperative_mailbox():
    """Mail for a thread that does not hold the turn (not a rank's job) wakes it when put, or the wait
    times out naming what it waited for."""
    world = xcp.LocalWorld(2, timeout=0.3, cooperative=True)
    timer = threading.Timer(0.05, world.mail.put, args=(("post", 0, 1, "kv", 0), "item"))
    timer.start()
    assert world.mail.take(0, ("post", 0, 1, "kv", 0), lambda: "the item") == "item"
    timer.join()
    with pytest.raises(CommTimeout, match=r"rank 0 waited 0\.3 s for the item; is a peer stuck or missing\?"):
        world.mail.take(0, ("post", 0, 1, "kv", 1), lambda: "the item")
