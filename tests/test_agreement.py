"""Ranks that disagree are told so, on every rank, the first time a configuration is used (xcp.agreement)."""

from __future__ import annotations

import pytest
import torch
from strategies import random_inputs

import xcp
from xcp import agreement, schedule
from xcp.backends.cpu import CPUBackend
from xcp.spec import CallSpec


def _base(rank: int) -> dict:
    q, k, v, _ = random_inputs(1, 12, 4, 2, 8, seed=5)
    return dict(q=q, k=k, v=v, causal=True, balance="zigzag", scale=None)


def _mutate(field: str, kw: dict) -> None:
    """Change ``field`` of rank 1's call."""
    if field == "causal":
        kw["causal"] = False
    elif field == "balance":
        kw["balance"] = "contiguous"
    elif field == "scale":
        kw["scale"] = 0.3
    elif field == "q.shape":  # a longer sequence: the local shards differ in length
        q, k, v, _ = random_inputs(1, 18, 4, 2, 8, seed=5)
        kw.update(q=q, k=k, v=v)
    elif field == "k.dtype":
        kw.update(q=kw["q"].float(), k=kw["k"].float(), v=kw["v"].float())


def _run(world_size: int, fn) -> list:
    """Each rank's return value or the message of the exception it raised."""

    def body(group):
        try:
            return fn(group)
        except ValueError as exc:
            return f"ValueError: {exc}"

    return xcp.LocalWorld(world_size, timeout=10).run(body)


def _call(group, kw: dict):
    p, r = group.size(), group.rank()
    local = [xcp.shard(kw[t], p, r, balance=kw["balance"]) for t in ("q", "k", "v")]
    return xcp.attention(*local, causal=kw["causal"], balance=kw["balance"], scale=kw["scale"], group=group)


@pytest.mark.parametrize("field", ["causal", "balance", "scale", "q.shape", "k.dtype"])
def test_every_rank_names_the_field_that_differs(field):
    def fn(group):
        kw = _base(group.rank())
        if group.rank() == 1:
            _mutate(field, kw)
        return _call(group, kw)

    results = _run(3, fn)
    assert all(isinstance(r, str) for r in results), results  # every rank raised
    assert len(set(results)) == 1, "every rank raises the same message"
    message = results[0]
    assert f"{field} (" in message
    assert "ranks 0, 2:" in message and "rank 1:" in message
    described = {
        "causal": "rank 1: False",
        "balance": "rank 1: 'contiguous'",
        "scale": "rank 1: 0.3",
        "q.shape": "rank 1: (1, 6, 4, 8)",
        "k.dtype": "rank 1: 'torch.float32'",
    }
    assert described[field] in message


def test_ranks_that_agree_run_and_are_checked_once_per_configuration(monkeypatch):
    gathers = []
    real = agreement.ring_gather

    def counting(comm, backend, mine):
        gathers.append(comm.rank())
        return real(comm, backend, mine)

    monkeypatch.setattr(agreement, "ring_gather", counting)
    kw = _base(0)
    other = dict(kw, causal=False)

    def fn(group):
        outs = [_call(group, kw) for _ in range(3)]
        outs.append(_call(group, other))
        outs.append(_call(group, kw))
        return outs

    results = _run(2, fn)
    assert sorted(gathers) == [0, 0, 1, 1], "one check per rank for each of the two configurations"
    for r in range(2):
        assert torch.equal(results[r][0], results[r][1])  # the check changes nothing in the result


def test_a_disagreement_is_not_remembered_as_agreed(monkeypatch):
    def fn(group):
        kw = _base(0)
        bad = dict(kw, causal=group.rank() == 0, scale=0.3)  # new to every rank, unlike the good call
        first = None
        try:
            _call(group, bad)
        except ValueError as exc:
            first = str(exc)
        good = dict(kw, causal=True)
        out = _call(group, good)
        try:  # the same disagreement again is caught again: it never joined the agreed set
            _call(group, bad)
        except ValueError as exc:
            return first, out, str(exc)
        return first, out, None

    results = _run(2, fn)
    for first, out, again in results:
        assert first is not None and "causal (" in first
        assert again == first
        assert out.shape == (1, 6, 4, 8)


def test_fingerprints_describe_themselves():
    q = torch.zeros(2, 8, 4, 16, dtype=torch.bfloat16)
    k = torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16)
    values = agreement.fingerprint(q, k, k, True, "stripe", 0.125)
    assert agreement.describe(values) == {
        "causal": True,
        "balance": "stripe",
        "scale": 0.125,
        "q.shape": (2, 8, 4, 16),
        "k.shape": (2, 8, 2, 16),
        "v.shape": (2, 8, 2, 16),
        "q.dtype": "torch.bfloat16",
        "k.dtype": "torch.bfloat16",
        "v.dtype": "torch.bfloat16",
        "cu_seqlens": None,
        "sinks": None,
        "window": None,
        "ulysses": 1,
        "softcap": None,
        "alibi_slopes": None,
        "chunk": None,
    }
    assert agreement.disagreement([values, values]) is None
    docs = agreement.fingerprint(q, k, k, True, "stripe", 0.125, (0, 3, 8), torch.zeros(4), (None, 0))
    described = agreement.describe(docs)
    assert described["window"] == (None, 0)
    assert described["cu_seqlens"].startswith("2 documents (crc32 ") and described["sinks"] == "[4] torch.float32"
    other = agreement.fingerprint(q, k, k, True, "stripe", 0.25)
    assert "scale (rank 0: 0.125; rank 1: 0.25)" in agreement.disagreement([values, other])
    hybrid = agreement.fingerprint(q, k, k, True, "stripe", 0.125, ulysses=2)
    assert agreement.describe(hybrid)["ulysses"] == 2
    variants = agreement.describe(agreement.fingerprint(q, k, k, True, "stripe", 0.125, None, None, None, 1, 30.0,
                                                        torch.zeros(4, dtype=torch.float64), 8192))  # fmt: skip
    assert (variants["softcap"], variants["alibi_slopes"], variants["chunk"]) == (30.0, "[4] torch.float64", 8192)
    assert "ulysses (rank 0: 1; rank 1: 2)" in agreement.disagreement([values, hybrid])


def test_the_agreed_set_is_bounded(monkeypatch):
    monkeypatch.setattr(agreement, "MAX_AGREED", 2)

    def fn(group):
        for scale in (0.1, 0.2, 0.3):
            _call(group, dict(_base(0), scale=scale))
        return len(agreement.agreed_set(group))

    assert _run(2, fn) == [1, 1]


def test_the_fingerprint_covers_the_agreed_fields_of_the_call_spec():
    """Every field of xcp.spec.CallSpec marked agreed is in the fingerprint (documents as cu_seqlens), and
    the per-rank choices (slots, handoff) are not: ranks may keep their buffers as each likes."""
    from xcp.spec import agreed_fields, spec_fields

    named = {"documents": "cu_seqlens"}
    assert {named.get(f, f) for f in agreed_fields()} <= set(agreement.FIELDS)
    assert {f.name for f in spec_fields()} - set(agreed_fields()) == {"slots", "handoff"}
    assert not {"slots", "handoff"} & set(agreement.FIELDS)


def test_the_check_is_never_issued_while_capturing(monkeypatch):
    """Capture cannot read a result on the host: the check waits for the eager call (the warm-up)."""
    gathers = []
    real = agreement.ring_gather

    def counting(comm, backend, mine):
        gathers.append((comm.rank(), backend.capturing))
        return real(comm, backend, mine)

    class Capturing(CPUBackend):
        capturing = False

        def is_capturing(self) -> bool:
            return self.capturing

    monkeypatch.setattr(agreement, "ring_gather", counting)
    q, k, v, _ = random_inputs(1, 12, 4, 2, 8, seed=5)
    spec = CallSpec(causal=True, scale=0.5)

    def fn(group):
        be = Capturing()
        be.capturing = True
        agreement.check_agreement(group, be, q, k, v, spec)  # skipped: not agreed, and nothing exchanged
        be.capturing = False
        agreement.check_agreement(group, be, q, k, v, spec)  # checked now
        agreement.check_agreement(group, be, q, k, v, spec)  # agreed: skipped

    _run(2, fn)
    assert sorted(gathers) == [(0, False), (1, False)]


def test_descriptions_at_the_edges_of_each_field():
    """Zero is a value (an empty dim, no documents, no sinks or slopes, a chunk of 0), -1 the absent one."""
    q, kv, none = torch.zeros(1, 0, 2, 4), torch.zeros(1, 0, 1, 4), torch.zeros(0)
    values = agreement.fingerprint(q, kv, kv, True, "zigzag", 0.5, (0,), none, (0, None), alibi_slopes=none, chunk=0)
    d = agreement.describe(values)
    assert (d["q.shape"], d["k.shape"], d["balance"], d["window"]) == ((1, 0, 2, 4), (1, 0, 1, 4), "zigzag", (0, None))
    assert d["cu_seqlens"].startswith("0 documents (crc32 ")
    assert d["sinks"] == d["alibi_slopes"] == "[0] torch.float32"
    assert (d["chunk"], d["ulysses"], d["softcap"]) == (0, 1, None)  # ulysses 1 by default: the ring alone
    unknown = list(values)
    unknown[1] = len(schedule.ALL_BALANCES)  # a balance this rank does not know is shown as its number
    assert agreement.describe(unknown)["balance"] == len(schedule.ALL_BALANCES)


def test_a_disagreement_names_only_the_fields_that_differ():
    q, k, v, _ = random_inputs(1, 12, 4, 2, 8, seed=5)
    rows = [agreement.fingerprint(q, k, v, causal, "zigzag", 0.5) for causal in (True, True, False)]
    assert agreement.disagreement(rows[:1]) is None  # a group of one agrees with itself
    message = agreement.disagreement(rows)
    assert "causal (ranks 0, 1: True; rank 2: False)" in message
    assert not any(f"{field} (" in message for field in agreement.FIELDS if field != "causal")


def test_shapes_carry_the_global_length_under_a_document_balance_only():
    """document_zigzag's shards may differ by a token: ranks holding 5 and 4 of 9 tokens agree, and a real
    difference (the heads) names each rank's shape with the global length 9. Under zigzag the shards are
    equal, and the message names each rank's own shard shape, as the rank passed it."""
    docs = (0, 3, 9)

    def shards(lengths, heads):
        return [
            [torch.zeros(1, n, h, 8), torch.zeros(1, n, 2, 8), torch.zeros(1, n, 2, 8)] for n, h in zip(lengths, heads)
        ]

    def rows(balance, lengths, heads):
        return [agreement.fingerprint(*s, True, balance, 0.5, docs) for s in shards(lengths, heads)]

    assert agreement.disagreement(rows("document_zigzag", (5, 4), (4, 4))) is None
    message = agreement.disagreement(rows("document_zigzag", (5, 4), (4, 2)))
    assert "q.shape (rank 0: (1, 9, 4, 8); rank 1: (1, 9, 2, 8))" in message
    assert "k.shape" not in message  # equal but for the token the balance allows
    message = agreement.disagreement(rows("zigzag", (3, 3, 3), (4, 4, 2)))
    assert "q.shape (ranks 0, 1: (1, 3, 4, 8); rank 2: (1, 3, 2, 8))" in message


def test_process_ranks_share_one_agreed_set_per_group_membership():
    """A rank that is a process (torch.distributed) calls from several threads: they share the group's agreed
    set, so a configuration is checked once per process; a group of other members checks it afresh (its
    ranks have agreed on nothing yet)."""
    import threading

    class ProcessRank:
        ranks_are_threads = False

        def __init__(self, members):
            self.members = members

        def rank_store(self):
            raise AssertionError("a process rank's set is per group membership, not per thread")

    sets = []
    threads = [threading.Thread(target=lambda: sets.append(agreement.agreed_set(ProcessRank((0, 1))))) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert sets[0] is sets[1] is agreement.agreed_set(ProcessRank((0, 1)))
        assert agreement.agreed_set(ProcessRank((0, 2))) is not sets[0]
    finally:
        for members in ((0, 1), (0, 2)):
            agreement._process_agreed.pop(members, None)


def test_every_rank_gathers_every_fingerprint_in_p_minus_1_hops():
    """The check costs each rank P - 1 small messages, once per configuration, and gives every rank the rows
    of all ranks in rank order."""
    hops: list[int] = []

    def fn(group):
        class Counting:
            def __getattr__(self, name):
                return getattr(group, name)

            def exchange(self, *args, **kwargs):
                hops.append(group.rank())
                return group.exchange(*args, **kwargs)

        return agreement.ring_gather(Counting(), CPUBackend(), torch.tensor([group.rank(), 7]))

    assert _run(4, fn) == [[[r, 7] for r in range(4)]] * 4
    assert sorted(hops) == [r for r in range(4) for _ in range(3)]


def test_a_new_local_world_has_agreed_on_nothing():
    """Virtual ranks keep their agreed set per world: a configuration agreed in one LocalWorld is checked
    again in the next, so ranks of the new world that disagree are all told so (none skips the check while
    its peers wait in it)."""
    kw = _base(0)
    assert all(not isinstance(r, str) for r in _run(2, lambda group: _call(group, kw)))

    def fn(group):
        return _call(group, kw if group.rank() == 0 else dict(kw, causal=False))

    results = _run(2, fn)
    assert all(isinstance(r, str) and "causal (rank 0: True; rank 1: False)" in r for r in results), results
