"""xcp.PagedDecode: a ragged decode step planned on the host, run by device ops alone, over virtual ranks.

Requests join (a prompt appended to the cache), decode one token a step and leave (their blocks freed); every
step's output on every rank is checked against float64 attention over the request's whole history (no xcp
code). On the CPU the step runs with the host's reads of tensor values refused and its inputs in buffers kept
from one step of a padded size to the next, as a captured graph has them; on CUDA the same workload runs
captured once per padded size and replayed, against the same steps run eagerly.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import threading

import pytest
import torch

import xcp
from xcp.comm import LocalWorld
from xcp.inference.paged_decode import decode_padding, padded_sizes

H, HKV, D = 4, 2, 8
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")
_guard = threading.local()


@contextlib.contextmanager
def _no_host_reads():
    """Within (on this thread): a Python read of any tensor's value fails, as it would freeze into a graph."""
    _guard.on = True
    try:
        yield
    finally:
        _guard.on = False


@pytest.fixture
def refuse_host_reads(monkeypatch):
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def refusing(self, *args, _real=real, _name=name, **kwargs):
            assert not getattr(_guard, "on", False), f"the step read a tensor's value on the host ({_name})"
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, refusing)


def _workload(seed: int, steps: int, max_batch: int, prompt_max: int = 9):
    """Per step: (requests leaving before it, requests joining with their prompt length, the requests that
    decode): a request decodes 1 to 9 tokens and leaves; joins keep at most ``max_batch`` active."""
    rng = random.Random(seed)
    active: dict[int, int] = {}  # id -> tokens still to decode
    plan, next_id = [], 0
    for _ in range(steps):
        leave = [i for i, left in active.items() if left == 0]
        for i in leave:
            del active[i]
        join = []
        while len(active) < max_batch and (not active or rng.random() < 0.4):
            join.append((next_id, rng.randint(1, prompt_max)))
            active[next_id] = rng.randint(1, 9)
            next_id += 1
        decoding = list(active)
        rng.shuffle(decoding)
        for i in decoding:
            active[i] -= 1
        plan.append((leave, join, decoding))
    return plan, next_id


def _tokens(n_ids: int, length: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(length, h, D, generator=g, dtype=torch.float64).to(dtype) for h in (H, HKV, HKV)]
            for _ in range(n_ids)]  # fmt: skip


def _reference(tokens, plan, max_len):
    """float64 attention of each decoding request's newest query over its whole history, per step."""
    lengths: dict[int, int] = {}
    wants = []
    for leave, join, decoding in plan:
        for i in leave:
            del lengths[i]
        for i, n in join:
            lengths[i] = n
        rows = []
        for i in decoding:
            n = lengths[i] = lengths[i] + 1
            q, k, v = (x[:n].double() for x in tokens[i])
            k, v = (x.repeat_interleave(H // HKV, 1) for x in (k, v))
            p = torch.softmax(torch.einsum("hd,shd->hs", q[n - 1], k) / math.sqrt(D), -1)
            rows.append(torch.einsum("hs,shd->hd", p, v))
        wants.append(torch.stack(rows))
    return wants


def _rank(group, tokens, plan, *, block_size, num_blocks, max_batch, max_len, dtype, sizes=None, interleave=1):
    cache = xcp.PagedKVCache(group, num_blocks=num_blocks, block_size=block_size, interleave=interleave)
    decode = None
    lengths: dict[int, int] = {}
    outs, buffers, statics = [], None, {}
    for leave, join, decoding in plan:
        for i in leave:
            cache.free(i)
            del lengths[i]
        if join:
            ids = [i for i, _ in join]
            cu = [0]
            for _, n in join:
                cu.append(cu[-1] + n)
            k, v = (torch.cat([tokens[i][j][:n] for i, n in join]) for j in (1, 2))
            cache.append(ids, k, v, cu)
            lengths.update(join)
        if decode is None:
            decode = xcp.PagedDecode(cache, max_batch=max_batch, max_len=max_len, sizes=sizes)
        batch = decode.plan(decoding)
        if buffers is None:
            buffers = {name: t.data_ptr() for name, t in decode._buffers.items()}
        q, k, v = (torch.stack([tokens[i][j][lengths[i]] for i in decoding]) for j in range(3))
        static = statics.setdefault(batch, decode_padding(batch, q, k, v))  # a graph's inputs: kept per size
        for x, new in zip(static, decode_padding(batch, q, k, v)):
            x.copy_(new)
        with _no_host_reads():
            out = decode.step(*static)
        assert out.shape == (batch, H, D) and not out.isnan().any()
        assert torch.equal(out[len(decoding) :], torch.zeros_like(out[len(decoding) :]))  # padded rows: 0
        outs.append(out[: len(decoding)].clone())
        for i in decoding:
            lengths[i] += 1
    assert {name: t.data_ptr() for name, t in decode._buffers.items()} == buffers  # made once, updated in place
    held = sum(len(cache.block_table(i)) for i in cache.seq_ids())
    return outs, cache.free_blocks + held == cache.num_blocks


@pytest.mark.parametrize("world,block_size,interleave", [(1, 4, 1), (3, 4, 1), (2, 256, 1), (3, 4, 2)])
def test_paged_decode_matches_float64_with_requests_joining_and_leaving(refuse_host_reads, world, block_size,
                                                                       interleave):  # fmt: skip
    steps, max_batch, max_len = 40, 6, 24
    plan, n_ids = _workload(world * 7 + block_size, steps, max_batch)
    tokens = _tokens(n_ids, max_len, seed=world)
    with LocalWorld(world) as w:
        results = w.run(lambda g: _rank(g, tokens, plan, block_size=block_size, num_blocks=64, max_batch=max_batch,
                                        max_len=max_len, dtype=torch.float64, interleave=interleave))  # fmt: skip
    wants = _reference(tokens, plan, max_len)
    for outs, pool_ok in results:
        assert pool_ok
        for step, (got, want) in enumerate(zip(outs, wants)):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=f"step {step}")
        for got, first in zip(outs, results[0][0]):
            assert torch.equal(got, first)  # the same on every rank


def test_padded_rows_write_only_the_sink_and_come_out_zero():
    """A step of 3 requests padded to 4: the pool changes only at the new tokens' slots on the rank that keeps
    each (position 5 of 2 ranks: rank 1) and in the sink block (the padded row's huge key and value, and the
    tokens another rank keeps); the padded row is exactly 0, nothing NaN."""
    tokens = _tokens(3, 12, seed=3)

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=8, block_size=4)
        cache.append([0, 1, 2], *(torch.cat([tokens[i][j][:5] for i in range(3)]) for j in (1, 2)), [0, 5, 10, 15])
        decode = xcp.PagedDecode(cache, max_batch=4, max_len=12)
        before = [cache.local_len(i) for i in range(3)]
        assert decode.plan([2, 0, 1]) == 4
        q, k, v = decode_padding(4, *(torch.stack([tokens[i][j][5] for i in (2, 0, 1)]) for j in range(3)))
        k[3], v[3], q[3] = 1e30, -1e30, 7.0  # a padded row: finite garbage
        pool_k, pool_v = cache._k.clone(), cache._v.clone()
        out = decode.step(q, k, v)
        changed = (cache._k != pool_k).flatten(2).any(-1) | (cache._v != pool_v).flatten(2).any(-1)
        written = {(int(b), int(r)) for b, r in changed.nonzero()}
        new_rows = {
            (cache.block_table(i)[j // 4], j % 4) for i in range(3) for j in range(before[i], cache.local_len(i))
        }
        return out, written, new_rows, cache.sink_block

    with LocalWorld(2) as w:
        results = w.run(rank)
    for r, (out, written, new_rows, sink) in enumerate(results):
        assert torch.equal(out[3], torch.zeros_like(out[3])) and not out.isnan().any()
        assert len(new_rows) == (3 if r == 1 else 0)
        assert {(b, row) for b, row in written if b != sink} == new_rows
        assert any(b == sink for b, _ in written)  # the padded row went there


def test_paged_decode_refuses_what_it_cannot_do():
    tokens = _tokens(3, 8, seed=1)
    cache = xcp.PagedKVCache(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="cache: expected a pool that holds tokens"):
        xcp.PagedDecode(cache, max_batch=2, max_len=8).plan(["a"])
    cache.append(["a", "b"], torch.cat([tokens[0][1][:4], tokens[1][1][:4]]),
                 torch.cat([tokens[0][2][:4], tokens[1][2][:4]]), [0, 4, 8])  # fmt: skip
    decode = xcp.PagedDecode(cache, max_batch=2, max_len=5)
    with pytest.raises(RuntimeError, match=r"step: expected a plan first"):
        decode.step(*decode_padding(1, tokens[0][0][:1], tokens[0][1][:1], tokens[0][2][:1]))
    with pytest.raises(KeyError, match="seq_id: expected a sequence the cache holds; got 'zz'"):
        decode.plan(["zz"])
    with pytest.raises(ValueError, match="seq_ids: expected 1 to max_batch = 2 requests; got 3"):
        decode.plan(["a", "b", "c"])
    with pytest.raises(ValueError, match="seq_ids: expected distinct ids"):
        decode.plan(["a", "a"])
    with pytest.raises(ValueError, match="num_blocks: expected a pool that holds the step"):
        decode.plan(["a", "b"])  # both need a third block
    assert cache.seq_len("a") == 4 and cache.free_blocks == 0  # refused: nothing changed
    cache.free("b")
    assert decode.plan(["a"]) == 1
    with pytest.raises(ValueError, match=r"q: expected \[1, 4, 8\] torch.float64 on cpu .*; got \[2, 4, 8\]"):
        decode.step(tokens[0][0][:2], tokens[0][1][:1], tokens[0][2][:1])
    with pytest.raises(
        ValueError, match=r"k: expected \[1, 2, 8\] torch.float64 on cpu .*; got \[1, 2, 8\] torch.float32"
    ):
        decode.step(tokens[0][0][:1], tokens[0][1][:1].float(), tokens[0][2][:1])
    decode.step(tokens[0][0][4:5], tokens[0][1][4:5], tokens[0][2][4:5])  # the refusals left the plan pending
    with pytest.raises(RuntimeError, match=r"step: expected a plan first .* since the last step"):
        decode.step(tokens[0][0][4:5], tokens[0][1][4:5], tokens[0][2][4:5])
    with pytest.raises(ValueError, match="max_len: expected every request to stay within PagedDecode"):
        decode.plan(["a"])  # a would reach 6 > max_len 5
    with pytest.raises(ValueError, match="sizes: expected ascending distinct sizes"):
        xcp.PagedDecode(cache, max_batch=4, max_len=8, sizes=(2, 1, 4))
    with pytest.raises(ValueError, match="max_batch: expected a positive integer; got 0"):
        xcp.PagedDecode(cache, max_batch=0, max_len=8)
    assert padded_sizes(6) == (1, 2, 4, 6) and padded_sizes(1) == (1,)


# ---------------------------------------------------------------------- xcp bench --serve
SERVE_FLAGS = ["bench", "--serve", "--device", "cpu", "--serve-requests", "5", "--serve-lengths", "8:200:400",
               "--serve-world", "3", "--serve-block", "8", "--serve-chunk", "12", "--serve-steps", "10",
               "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "float64", "--warmup", "0",
               "--reps", "1", "--quiet"]  # fmt: skip


def test_bench_serve_checks_then_times_every_figure(tmp_path, capsys):
    """Decode and the mixed step over 3 virtual ranks checked against the whole pool's one call and float64,
    then timed; the memory figure's requests come and go (no memory statistics on the CPU); bytes per rank."""
    from xcp.cli import main

    path = tmp_path / "serve.json"
    assert main([*SERVE_FLAGS, "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "decode eager" in text and "mixed eager" in text and "FAIL" not in text
    data = json.loads(path.read_text())
    assert data["config"]["lengths"][0] == 8 and data["config"]["lengths"][-1] == 200
    assert data["config"]["xcp_pools"] == "gathered" and "xcp's pools gathered" in text  # the CPU: the math kernel
    assert data["decode"]["check_ok"] and data["mixed"]["check_ok"] and data["mixed"]["chunk"] == 12
    assert max(data["decode"]["errors"].values()) < 1e-9 and data["memory"]["requests_seen"] > 5
    assert sum(data["decode"]["tokens_per_rank"]) == data["decode"]["tokens"] + 5  # + the one timed step


def test_bench_serve_check_is_against_the_whole_pool(monkeypatch, capsys):
    """A whole-pool yardstick 10% off fails the checks and the exit status is 1."""
    from xcp.cli import main
    from xcp.cli.bench import serve

    real = serve.Whole.step
    monkeypatch.setattr(serve.Whole, "step", lambda self, q, k, v: real(self, q, k, v) * 1.1)
    assert main(SERVE_FLAGS) == 1
    assert "FAIL" in capsys.readouterr().out


def _flat_yardstick(monkeypatch, wrong=False):
    """The bench with its CUDA yardstick (contiguous K/V, one flash varlen call with seqused_k) on the CPU: the op
    a stand-in of the aten flash varlen op (tests/test_cuda_backend.py's FakeAten: float64 math per segment, bf16 or
    fp16 only, its arguments checked as flash's); ``wrong``: the yardstick 10% off."""
    from test_cuda_backend import FakeAten

    from xcp.cli.bench import serve, serve_yardstick

    fake = FakeAten()
    monkeypatch.setattr(serve, "choose", lambda *a: serve_yardstick.FLAT)
    monkeypatch.setattr(serve_yardstick, "_flash_op", lambda: fake._flash_attention_forward)
    if wrong:
        real = serve.Flat.step
        monkeypatch.setattr(serve.Flat, "step", lambda self, q, k, v: real(self, q, k, v) * 1.1)
    return fake


@pytest.mark.parametrize("wrong", [False, True])
def test_bench_serve_yardstick_is_one_flash_varlen_call_over_contiguous_tokens(tmp_path, monkeypatch, capsys, wrong):
    """Every request's tokens in one contiguous buffer and ONE flash varlen call with cum_seq_k the regions' starts
    and seqused_k the lengths, a decode step and the mixed step's causal chunk alike, requests joining into regions
    reserved for them: xcp checked against it and it against float64 (bf16); one 10% off fails (exit 1)."""
    from xcp.cli import main

    fake = _flat_yardstick(monkeypatch, wrong)
    path = tmp_path / "serve.json"
    flags = [
        *SERVE_FLAGS[: SERVE_FLAGS.index("--dtype") + 1],
        "bfloat16",
        *SERVE_FLAGS[SERVE_FLAGS.index("--dtype") + 2 :],
    ]
    assert main([*flags, "--json", str(path)]) == (1 if wrong else 0)
    text = capsys.readouterr().out
    assert "flash varlen with seqused_k over contiguous K/V" in text and ("FAIL" in text) == wrong
    data = json.loads(path.read_text())
    assert data["config"]["yardstick"] == "flash varlen with seqused_k over contiguous K/V"
    decodes = [c for c in fake.calls if c[0] == "flash_varlen_fwd" and not c[4]]
    chunks = [c for c in fake.calls if c[0] == "flash_varlen_fwd" and c[4]]
    assert len(decodes) == 2 and len(chunks) == 2  # the checked step and the timed one, of each figure
    cu_q, cu_k, used, max_q, _ = fake.lengths[0]  # the checked decode step: every request one token over its regions
    assert cu_q == list(range(6)) and max_q == 1 and cu_k[:5] == sorted(set(cu_k[:5]))
    assert used == [n + 1 for n in data["config"]["lengths"]]
    if not wrong:
        assert (
            data["decode"]["errors"]["whole_vs_float64"] < 2e-2 and data["mixed"]["errors"]["whole_vs_float64"] < 2e-2
        )


def test_bench_serve_says_how_xcps_pools_are_read(monkeypatch):
    """In place for every call, for the decode calls alone (``paged_in_place(..., max_q=1)``), or gathered."""
    from xcp.backends.cpu import CPUBackend
    from xcp.cli.bench.serve import _pools_read

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    cache = xcp.PagedKVCache(num_blocks=4, block_size=4)
    cache.append([0], k, v, [0, 3])
    q = torch.randn(1, H, D, generator=g, dtype=torch.float64)
    assert _pools_read(CPUBackend(), cache, q) == "gathered"
    monkeypatch.setattr(CPUBackend, "paged_in_place", lambda self, q, k, v, max_q=None: max_q == 1)
    assert _pools_read(CPUBackend(), cache, q).startswith("in place for decode calls")
    monkeypatch.setattr(CPUBackend, "paged_in_place", lambda self, q, k, v: True)
    assert _pools_read(CPUBackend(), cache, q) == "in place (every call)"


def test_long_tail_spans_its_ends_and_sums_near_the_total():
    from xcp.cli.bench.serve import long_tail

    lengths = long_tail(32, 4096, 262144, 1_500_000)
    assert lengths[0] == 4096 and lengths[-1] == 262144 and lengths == sorted(lengths)
    assert abs(sum(lengths) - 1_500_000) < 0.02 * 1_500_000


def test_a_plan_is_not_captured_and_values_in_keys_take_no_v(monkeypatch):
    """A plan writes the step's metadata from the host: refused while a graph is captured. A cache keeping its
    values in its keys' channels takes v=None, and the step matches float64 with v the keys' first channels."""
    from xcp.backends.cpu import CPUBackend

    tokens = _tokens(2, 8, seed=2)
    cache = xcp.PagedKVCache(num_blocks=4, block_size=4, values_in_keys=D)
    cache.append([0, 1], torch.cat([tokens[0][1][:3], tokens[1][1][:6]]), None, [0, 3, 9])
    decode = xcp.PagedDecode(cache, max_batch=2, max_len=8)
    with monkeypatch.context() as m:
        m.setattr(CPUBackend, "is_capturing", lambda self: True)
        with pytest.raises(RuntimeError, match="plan: expected no device-graph capture"):
            decode.plan([0, 1])
    assert cache.seq_len(0) == 3
    assert decode.plan([1, 0]) == 2
    q, k = (torch.stack([tokens[i][j][n] for i, n in ((1, 6), (0, 3))]) for j in (0, 1))
    with pytest.raises(ValueError, match="v: expected None exactly where the cache keeps values_in_keys"):
        decode.step(q, k, k)
    out = decode.step(q, k, None)
    for row, (i, n) in enumerate(((1, 7), (0, 4))):
        keys = tokens[i][1][:n].repeat_interleave(H // HKV, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", tokens[i][0][n - 1], keys) / math.sqrt(D), -1)
        torch.testing.assert_close(out[row], torch.einsum("hs,shd->hd", p, keys), atol=1e-10, rtol=0)


def test_sanitized_serving_with_paged_decode_steps_is_clean_and_sees_a_dropped_hand_off(monkeypatch):
    """``xcp sanitize --serve``'s workload on the simulated device with its decode steps through PagedDecode:
    clean, exact and the pool audited after every step; without the combine's hand-off in the decode steps
    alone, the all-gather's read of their packed partial races its write."""
    from xcp.lifetime import RingCall
    from xcp.testing.serve_sanitizer import sanitize_serve

    plans = []
    real = xcp.PagedDecode.plan
    monkeypatch.setattr(xcp.PagedDecode, "plan", lambda self, ids: plans.append(ids) or real(self, ids))
    report = sanitize_serve(requests=5, world=3, decode=True)
    assert report.ok, report.format()
    assert report.max_error["out"] < 1e-12 and len(plans) >= 3 * 3  # several decode steps on each rank
    in_step = threading.local()
    real_step, real_hand = xcp.PagedDecode.step, RingCall.hand_to_comm

    def step(self, *args):
        in_step.on = True
        try:
            return real_step(self, *args)
        finally:
            in_step.on = False

    def hand(self, tensors, channel, ordered=False):  # dropped in PagedDecode's steps alone
        return list(tensors) if getattr(in_step, "on", False) else real_hand(self, tensors, channel, ordered)

    with monkeypatch.context() as m:
        m.setattr(xcp.PagedDecode, "step", step)
        m.setattr(RingCall, "hand_to_comm", hand)
        report = sanitize_serve(requests=5, world=3, decode=True)
    races = [f for f in report.findings if f.kind == "race"]
    assert any(any("p2p combine" in a.op for a in f.accesses) for f in races), report.format()


def test_run_serve_with_paged_decode_checks_every_step(capsys):
    from xcp.cli import main

    assert main(["run", "--serve", "4", "--world", "2", "--paged-decode"]) == 0
    text = capsys.readouterr().out
    assert "decode steps through PagedDecode" in text and "PASS" in text and "FAIL" not in text
    assert main(["plan", "--serve", "3", "--world", "2", "--paged-decode"]) == 2
    assert "--paged-decode: expected with xcp run --serve or xcp sanitize --serve" in capsys.readouterr().err
