"""The torch.distributed path: real processes over gloo on the CPU, 2 and 3 ranks (4 and 6 for the hybrid).

The parent writes seeded inputs to a temporary directory and starts one Python process per rank
(``init_method=file://``, no network port to pick). Each rank shards the same inputs, runs xcp.attention
forward and backward with ``group=None`` (the default group), with an explicit ``new_group`` of all ranks,
and, with 3 processes, on a sub-group of ranks 0 and 2 (group ranks differ from global ranks there), then
saves its shards. The parent unshards them and compares with the float64 whole-sequence reference.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import finish_ranks, gloo_worker, start_ranks
from strategies import random_inputs

import xcp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORKER = gloo_worker(
    """
    import xcp
    cases = torch.load(f"{workdir}/cases.pt")
    groups = {"default": None, "new": dist.new_group(list(range(world)))}
    if world == 3:
        groups["sub"] = dist.new_group([0, 2])  # every process must take part in new_group
    results = {}
    for name, case in cases.items():
        members = case["members"]
        if rank not in members:
            continue
        group = groups[case["group"]]
        p, r = len(members), members.index(rank)
        bal = case["balance"]
        local = [xcp.shard(case[t], p, r, balance=bal).requires_grad_() for t in ("q", "k", "v")]
        out = xcp.attention(*local, causal=case["causal"], balance=bal, group=group)
        out.backward(xcp.shard(case["dout"], p, r, balance=bal))
        results[name] = [out.detach()] + [t.grad for t in local]
    torch.save(results, f"{workdir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    """
)


def make_cases(world: int) -> dict[str, dict]:
    """Causal zigzag and non-causal contiguous, with GQA, on each kind of group; float64 inputs."""
    cases = {}
    configs = [("zigzag", True, 4, 2), ("contiguous", False, 4, 1), ("stripe", True, 2, 2)]
    group_kinds = [("default", list(range(world))), ("new", list(range(world)))]
    if world == 3:
        group_kinds.append(("sub", [0, 2]))
    seed = 0
    for group, members in group_kinds:
        for balance, causal, heads, kv_heads in configs:
            seed += 1
            p = len(members)
            q, k, v, dout = random_inputs(2, 2 * p * 3, heads, kv_heads, 6, seed=seed)
            name = f"{group}-{balance}-{'causal' if causal else 'full'}-h{heads}kv{kv_heads}"
            cases[name] = dict(q=q, k=k, v=v, dout=dout, causal=causal, balance=balance, group=group, members=members)
    return cases


def run_ranks(world: int, workdir: Path, timeout: float = 120) -> None:
    finish_ranks(start_ranks(WORKER, world, workdir), timeout)


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_matches_the_reference(tmp_path, reference, world):
    cases = make_cases(world)
    torch.save(cases, tmp_path / "cases.pt")
    run_ranks(world, tmp_path)
    per_rank = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(world)}
    for name, case in cases.items():
        parts = [per_rank[r][name] for r in case["members"]]
        for r in range(world):
            assert (name in per_rank[r]) == (r in case["members"]), f"{name}: rank {r}"
        want = reference(case["q"], case["k"], case["v"], case["dout"], case["causal"])
        for i, tensor in enumerate(("out", "dq", "dk", "dv")):
            got = xcp.unshard([p[i] for p in parts], balance=case["balance"])
            assert got.dtype == torch.float64
            err = (got - getattr(want, tensor)).abs().max().item()
            assert err <= 1e-10, f"{name} {tensor}: max abs error {err:.3e}"


FAULT_WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    import xcp

    rank, world, workdir, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    # no timeout given: the default group keeps gloo's default (30 minutes)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6 * world, 2, 4, dtype=torch.float64) for _ in range(3))
    local = [xcp.shard(x, world, rank) for x in (q, k, v)]

    def outcome(fn):
        start = time.monotonic()
        try:
            fn()
            return {"ok": True, "seconds": time.monotonic() - start}
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}

    results = {}
    if scenario == "disagree":  # rank 1 alone asks for full attention, then all agree
        results["first"] = outcome(lambda: xcp.attention(*local, causal=rank != 1))
        results["then"] = outcome(lambda: xcp.attention(*local, causal=True))
    elif scenario == "asleep":  # a group with its own 5-s timeout; rank 1 sleeps before its second K/V exchange
        from xcp.comm import DistCommunicator

        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
        results["bounds"] = [DistCommunicator(g).wait_bound(torch.device("cpu")) for g in (None, group)]
        exchange, tags = DistCommunicator.exchange, []

        def sleepy(self, sends, recvs, tag, *args, **kwargs):
            tags.append(tag)
            if rank == 1 and tags.count("kv") == 2:
                time.sleep(120)
            return exchange(self, sends, recvs, tag, *args, **kwargs)

        DistCommunicator.exchange = sleepy
        local = [x.requires_grad_() for x in local]
        results["then"] = outcome(lambda: xcp.attention(*local, causal=True, group=group).sum().backward())
    else:  # "stuck": all agree once, then the last rank sleeps in user code while the others call again
        results["first"] = outcome(lambda: xcp.attention(*local, causal=True))
        if rank == world - 1:
            time.sleep(120)
        kwargs = {} if rank == 1 else {"timeout": 2}  # rank 1 takes its bound from XCP_TIMEOUT
        results["then"] = outcome(lambda: xcp.attention(*local, causal=True, **kwargs))
    with open(f"{workdir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    os._exit(0)  # no barrier or teardown: a peer may be asleep
    """
)


def run_fault_ranks(world: int, workdir: Path, scenario: str, wait_for: list[int], env_timeout: str = "2") -> dict:
    """Start ``world`` ranks of FAULT_WORKER with ``XCP_TIMEOUT=env_timeout`` ("": unset); wait (60 s at most)
    for the ranks ``wait_for``, kill the rest."""
    procs = start_ranks(FAULT_WORKER, world, workdir, scenario, XCP_TIMEOUT=env_timeout)
    try:
        logs = {}
        for r in wait_for:
            try:
                logs[r] = procs[r].communicate(timeout=60)[0]
            except subprocess.TimeoutExpired:
                pytest.fail(f"gloo rank {r} did not finish within 60 s ({scenario})")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    results = {}
    for r in wait_for:
        path = workdir / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result:\n{logs[r]}"
        results[r] = json.loads(path.read_text())
    return results


def test_a_stuck_gloo_peer_fails_the_others_within_the_bound(tmp_path):
    results = run_fault_ranks(3, tmp_path, "stuck", wait_for=[0, 1])
    for r in (0, 1):
        assert results[r]["first"]["ok"], results[r]
        then = results[r]["then"]
        assert then.get("error") == "CommTimeout", then
        assert then["seconds"] < 20, f"rank {r} waited {then['seconds']:.1f} s against a bound of 2 s"
        assert "no progress within 2 s" in then["message"] and "is rank 2 stuck" in then["message"]
    # rank 0 waits to receive from the sleeper; rank 1 to send to it: both at step 0 of the K/V ring
    assert results[0]["then"]["message"].startswith("xcp: rank 0 receiving kv0 from rank 2 at step 0")
    assert results[1]["then"]["message"].startswith("xcp: rank 1 sending kv0 to rank 2 at step 0")


def test_a_peer_asleep_fails_every_other_rank_within_the_groups_own_timeout(tmp_path):
    """Neither timeout= nor XCP_TIMEOUT: a group made with a 5-s timeout bounds xcp's waits by its 5 s (not
    xcp's default of 600 s), so both other ranks fail with CommTimeout naming themselves, the sleeper, the
    step and the tag; the default group (30 minutes) is bounded by xcp's default."""
    from xcp.comm import DEFAULT_TIMEOUT

    results = run_fault_ranks(3, tmp_path, "asleep", wait_for=[0, 2], env_timeout="")
    for r in (0, 2):
        assert results[r]["bounds"] == [DEFAULT_TIMEOUT, 5.0], results[r]
        then = results[r]["then"]
        assert then.get("error") == "CommTimeout", then
        assert then["seconds"] < 30, f"rank {r} waited {then['seconds']:.1f} s against the group's 5 s"
        assert "no progress within 5 s; is rank 1 stuck" in then["message"], then
        assert "the process group's own timeout" in then["message"], then
    # rank 0 waits to send to the sleeper, rank 2 to receive from it: both at step 1 of the K/V ring
    assert results[0]["then"]["message"].startswith("xcp: rank 0 sending kv0 to rank 1 at step 1"), results[0]
    assert results[2]["then"]["message"].startswith("xcp: rank 2 receiving kv0 from rank 1 at step 1"), results[2]


def test_gloo_ranks_that_disagree_all_raise_and_then_recover(tmp_path):
    results = run_fault_ranks(3, tmp_path, "disagree", wait_for=[0, 1, 2])
    messages = {results[r]["first"].get("message") for r in range(3)}
    assert len(messages) == 1, messages
    (message,) = messages
    assert {results[r]["first"].get("error") for r in range(3)} == {"ValueError"}
    assert "causal (ranks 0, 2: True; rank 1: False)" in message
    assert all(results[r]["then"].get("ok") for r in range(3)), results


def test_which_waits_xcp_bounds(monkeypatch):
    from xcp.comm import DEFAULT_TIMEOUT, DistCommunicator

    comm = DistCommunicator.__new__(DistCommunicator)  # the bound alone, without a process group
    comm.timeout, comm.group_timeout = None, 1800.0  # gloo's default group timeout: 30 minutes
    assert comm.wait_bound(torch.device("cpu")) == DEFAULT_TIMEOUT  # gloo's wait blocks the host anyway
    assert comm.wait_bound(torch.device("cuda", 0)) is None  # a stream wait: the process group's timeout
    comm.group_timeout = None  # a group whose timeout torch does not tell
    assert comm.wait_bound(torch.device("cpu")) == DEFAULT_TIMEOUT
    comm.group_timeout = 5.0  # the group's own, shorter: never outwaited
    assert comm.wait_bound(torch.device("cpu")) == 5.0
    assert comm.wait_bound(torch.device("cuda", 0)) is None
    comm.timeout = 3.0
    assert comm.wait_bound(torch.device("cuda", 0)) == 3.0  # asked for: the host waits, bounded
    comm.timeout = 60.0
    assert comm.wait_bound(torch.device("cpu")) == 60.0  # asked for: longer than the group's own, as asked


COMPILE_WORKER = gloo_worker(
    """
    import json
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.device_mesh import init_device_mesh
    import xcp
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8 * world, 2, 4, dtype=torch.float64) for _ in range(3))
    local = [xcp.shard(x, world, rank).requires_grad_() for x in (q, k, v)]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    groups = {"default": None, "new": dist.new_group(list(range(world))), "mesh": mesh, "mesh dim": mesh2["cp"]}
    eager = xcp.attention(*local, causal=True)
    eager_grads = torch.autograd.grad(eager.sum(), local)
    results = {}
    for name, group in groups.items():
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        fn = torch.compile(lambda q, k, v: xcp.attention(q, k, v, causal=True, group=group), fullgraph=True,
                           backend=counter)
        out = fn(*local)
        grads = torch.autograd.grad(out.sum(), local)
        plain = xcp.attention(*local, causal=True, group=group)  # eager with this group too
        results[name] = {
            "frames": counter.frame_count,
            "out": (out - eager).abs().max().item(),
            "plain": (plain - eager).abs().max().item(),
            "grads": max((g - w).abs().max().item() for g, w in zip(grads, eager_grads)),
        }
    try:
        xcp.attention(*local, causal=True, group=mesh2)
        results["2-d mesh"] = None
    except ValueError as exc:
        results["2-d mesh"] = str(exc)
    with open(f"{workdir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    """
)


def test_compiled_attention_and_device_mesh_groups_on_gloo(tmp_path):
    """torch.compile(fullgraph=True) on real ranks: one graph, equal to eager for the default group, a new
    group, a 1-D DeviceMesh and a named dim of a 2-D mesh; a 2-D mesh as group= is refused by name."""
    finish_ranks(start_ranks(COMPILE_WORKER, 2, tmp_path))
    for r in range(2):
        results = json.loads((tmp_path / f"rank{r}.json").read_text())
        for name in ("default", "new", "mesh", "mesh dim"):
            got = results[name]
            assert got["frames"] == 1, (r, name, got)
            assert got["out"] == 0.0 and got["grads"] == 0.0 and got["plain"] == 0.0, (r, name, got)
        assert "expected a DeviceMesh of 1 dim" in results["2-d mesh"] and "('dp', 'cp')" in results["2-d mesh"]


HYBRID_WORKER = gloo_worker(
    """
    import xcp
    cases = torch.load(f"{workdir}/cases.pt")
    groups = {"default": None, "new": dist.new_group(list(range(world)))}
    if world > 4:
        groups["sub"] = dist.new_group([1, 2, 3, 4])  # every process takes part in the user's new_group
    results = {}
    for name, case in cases.items():
        members = case["members"]
        if rank not in members:
            continue
        p, r, u, bal = len(members), members.index(rank), case["ulysses"], case["balance"]
        local = [xcp.shard(case[t], p, r, balance=bal, ulysses=u).requires_grad_() for t in ("q", "k", "v")]
        sinks = None if case["sinks"] is None else case["sinks"].clone().requires_grad_()
        cu = None if case["cu"] is None else torch.tensor(case["cu"])
        out = xcp.attention(*local, causal=case["causal"], balance=bal, group=groups[case["group"]], ulysses=u,
                            cu_seqlens=cu, window=case["window"], sinks=sinks)
        out.backward(xcp.shard(case["dout"], p, r, balance=bal, ulysses=u))
        results[name] = [out.detach()] + [t.grad for t in local] + [None if sinks is None else sinks.grad]
    from xcp.comm import DistCommunicator  # the default group's head group and ring, made (and cached) above

    results["sub-group timeouts"] = [c.group_timeout for c in DistCommunicator(None).hybrid_groups(2)]
    torch.save(results, f"{workdir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    """
)


def hybrid_cases(world: int) -> dict[str, dict]:
    """2 x 2 (and pure Ulysses, 4 x 1) on the default group and a new group of all ranks; with 6 processes
    also 2 x 2 on a sub-group of ranks 1..4. GQA with one K/V head (fewer than U), documents, a window, sinks."""
    configs = [  # group, ulysses, balance, causal, kv_heads, documents, window, sinks
        ("default", 2, "zigzag", True, 1, None, None, False),
        ("new", 2, "stripe", False, 2, None, None, False),
        ("default", 2, "contiguous", True, 2, (0, 5, 17, 32), (6, 0), True),
        ("new", 4, "zigzag", True, 1, (0, 9, 32), None, True),
        ("default", 2, "zigzag", False, 4, None, (3, 2), False),
    ]
    if world > 4:
        configs = [c for c in configs if c[0] == "default"][:2] + [
            ("sub", 2, "zigzag", True, 1, None, None, True),
            ("sub", 2, "stripe", True, 2, (0, 3, 30, 32), (5, 0), False),
        ]
    cases = {}
    for seed, (group, ulysses, balance, causal, kv_heads, cu, window, with_sinks) in enumerate(configs):
        members = [1, 2, 3, 4] if group == "sub" else list(range(world))
        seq = 48 if len(members) == 6 else 32  # 6 = 2 x 3: zigzag over 3 ring positions needs a multiple of 6
        q, k, v, dout = random_inputs(1, seq, 4, kv_heads, 4, seed=100 + seed)
        cu = None if cu is None else (*cu[:-1], seq)
        gen = torch.Generator().manual_seed(seed)
        sinks = torch.randn(4, dtype=torch.float64, generator=gen) if with_sinks else None
        name = f"{group}-U{ulysses}-{balance}-{'causal' if causal else 'full'}-kv{kv_heads}-{cu}-{window}-{with_sinks}"
        cases[name] = dict(q=q, k=k, v=v, dout=dout, causal=causal, balance=balance, group=group, members=members,
                           ulysses=ulysses, cu=cu, window=window, sinks=sinks)  # fmt: skip
    return cases


@pytest.mark.parametrize("world", [4, 6])
def test_gloo_hybrid_all_to_all_and_ring_matches_the_reference(tmp_path, world):
    """ulysses on real ranks: all_to_all_single in head groups made by new_group (every process, in the same
    order, for a group of all ranks; the members only, use_local_synchronization, for a sub-group), the ring
    over the ring sub-groups; out, dq, dk, dv and dsinks to 1e-10 against the float64 whole sequence."""
    from helpers import independent_masked_reference as masked_reference

    cases = hybrid_cases(world)
    torch.save(cases, tmp_path / "cases.pt")
    finish_ranks(start_ranks(HYBRID_WORKER, world, tmp_path))
    per_rank = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(world)}
    for r in range(world):  # the sub-groups xcp made keep the timeout of the group they split (60 s)
        assert per_rank[r]["sub-group timeouts"] == [60.0, 60.0], per_rank[r]["sub-group timeouts"]
    for name, case in cases.items():
        parts = [per_rank[r][name] for r in case["members"]]
        cu = case["cu"] or (0, case["q"].shape[1])
        want = masked_reference(case["q"], case["k"], case["v"], case["dout"], cu, case["causal"], case["sinks"],
                                window=case["window"])  # fmt: skip
        for i, tensor in enumerate(("out", "dq", "dk", "dv", "dsinks")):
            if i == 4:
                if case["sinks"] is None:
                    continue
                got = sum(p[4] for p in parts)
            else:
                got = xcp.unshard([p[i] for p in parts], balance=case["balance"], ulysses=case["ulysses"])
            err = (got - want[i]).abs().max().item()
            assert err <= 1e-10, f"{name} {tensor}: max abs error {err:.3e}"
