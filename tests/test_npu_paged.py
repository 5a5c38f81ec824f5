"""xcp_npu's paged partial (forward_paged through npu_fused_infer_attention_score) and the serving combine on Ascend,
against a CPU stand-in of torch_npu as strict as the op's page (tests/npu_standin.py, xcp_npu/paged.py).

References are float64 attention of each segment's rows gathered from the pool by hand. The stand-in computes in
float32 and rounds its output to float16, as the device does: outputs compare within 2e-3 of max(1, |ref|) (float16's
half-ulp at 1 is 5e-4, and the merge of a few partials adds a few), lse within 1e-5 (float32); a wrong block, length,
mask alignment or head mapping is off by O(0.1).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from helpers import installed
from npu_standin import FakeTorchNPU, FakeTorchNPU6, NPUGlueOnCPU, NPUOnCPU, NPUOnSim
from strategies import assert_close_to

import xcp
from xcp import lifetime
from xcp.backends.base import Backend
from xcp.comm import LocalWorld
from xcp.inference.paged_decode import PagedDecode, decode_padding
from xcp.testing import conformance
from xcp.testing.serve_sanitizer import sanitize_serve
from xcp_npu import NPUBackend, paged

NEG_INF = float("-inf")
TOL = 2e-3


@pytest.fixture
def fake(monkeypatch):
    stand_in = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    return stand_in


def _rand(*shape, dtype=torch.float16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _problem(segments, block, h=8, hkv=2, d=32, blocks=8, dtype=torch.float16):
    """Packed q [T, h, d], pools [blocks, block, hkv, d], the int32 table (entries past a segment's blocks: the last
    block, random tokens never to be read), cu_q, seqused_k, max_q, max_k for ``segments`` = (queries, keys, blocks)."""
    t = sum(n for n, _, _ in segments)
    q = _rand(t, h, d, dtype=dtype, seed=1)
    k_pool, v_pool = (_rand(blocks, block, hkv, d, dtype=dtype, seed=s) for s in (2, 3))
    width = max(len(b) for _, _, b in segments) or 1
    table = torch.tensor([list(b) + [blocks - 1] * (width - len(b)) for _, _, b in segments], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor([n for n, _, _ in segments]).cumsum(0).tolist()], dtype=torch.int32)
    used = torch.tensor([k for _, k, _ in segments], dtype=torch.int32)
    return q, k_pool, v_pool, table, cu, used, max(n for n, _, _ in segments), max(k for _, k, _ in segments)


def _reference(q, k_pool, v_pool, segments, causal, scale):
    """float64 (out [T, H, D], lse [H, T]) of each segment's queries over its first keys, gathered by hand."""
    t, h, _ = q.shape
    out = torch.zeros(t, h, v_pool.shape[-1], dtype=torch.float64)
    lse = torch.full((h, t), NEG_INF, dtype=torch.float64)
    row = 0
    for n, keys, blocks in segments:
        if keys:
            k, v = (torch.cat([x[b] for b in blocks]).double()[:keys] for x in (k_pool, v_pool))
            groups = h // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            s = torch.einsum("thd,shd->hts", q[row : row + n].double(), k) * scale
            if causal:
                s = s.masked_fill(torch.arange(keys)[None] > torch.arange(n)[:, None] + keys - n, NEG_INF)
            lse[:, row : row + n] = torch.logsumexp(s, -1)
            out[row : row + n] = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v)
        row += n
    return out, lse


def _assert_matches(out, lse, want_out, want_lse, q):
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert_close_to("out", out, want_out, TOL)
    assert torch.equal(lse.isinf(), want_lse.isinf()) and not lse.isnan().any() and not out.isnan().any()
    finite = want_lse.isfinite()
    assert_close_to("lse", lse[finite], want_lse[finite], 1e-5)


# ---------------------------------------------------------------------------------------------- forward_paged
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_the_conformance_paged_cases_go_through_the_op(fake, dtype, causal, heads):
    """The suite's paged-* case (a decode row, a segment without keys, a chunk of 5 over 3 blocks of 256 rows) passes
    on NPUBackend with ONE op call: the keyless segment left out, Q_S 5, sparse_mode 3 when causal."""
    conformance.check_forward_paged(NPUOnCPU(), dtype, causal, heads)
    kv_heads = conformance.HEADS[heads][1]
    assert fake.infer_calls == [(5, [1, 5], [300, 700], kv_heads, 3 if causal else 0, conformance.PAGED_BLOCK)]


DECODE = [(1, 33, (4, 1, 6)), (1, 0, ()), (0, 7, (2,)), (1, 16, (3,)), (1, 1, (0,))]
"""One query per segment over blocks of 16: 33 keys over 3 blocks, a segment without keys, one without queries,
a whole block, a single key."""


@pytest.mark.parametrize("causal", [False, True])
def test_decode_rows_on_blocks_of_16_take_the_one_query_branch(fake, causal):
    """Decode rows read blocks of 16 rows in place (Q_S 1 takes blocks in multiples of 16): one call of the entries
    with a query and a key, GQA as num_key_value_heads, the rows of a keyless segment 0 and -inf; inputs unchanged."""
    args = _problem(DECODE, 16)
    before = [x.clone() for x in args[:6]]
    out, lse = NPUOnCPU().forward_paged(*args, 0.2, causal)
    _assert_matches(out, lse, *_reference(args[0], args[1], args[2], DECODE, causal, 0.2), args[0])
    assert (out[1] == 0).all() and (lse[:, 1] == NEG_INF).all()
    assert fake.infer_calls == [(1, None, [33, 16, 1], 2, 0, 16)]
    assert all(torch.equal(a, b) for a, b in zip(args[:6], before))


CHUNKS = [(3, 200, (5, 2)), (1, 0, ()), (4, 4, (1,)), (1, 129, (0, 3))]
"""Several queries per entry over blocks of 128: a chunk over 2 blocks, a keyless row, a square chunk, a decode row."""


@pytest.mark.parametrize("causal", [False, True])
def test_chunks_take_the_prompt_branch_aligned_bottom_right(fake, causal):
    args = _problem(CHUNKS, 128)
    out, lse = NPUOnCPU().forward_paged(*args, 0.2, causal)
    _assert_matches(out, lse, *_reference(args[0], args[1], args[2], CHUNKS, causal, 0.2), args[0])
    assert fake.infer_calls == [(4, [3, 4, 1], [200, 4, 129], 2, 3 if causal else 0, 128)]


def _fallback(case, monkeypatch, fake):
    """(backend, the problem's arguments, causal) of a call the op does not take."""
    backend, segments, block, causal, kwargs = NPUOnCPU(), CHUNKS, 128, False, {}
    if case == "float32":
        kwargs = {"dtype": torch.float32}
    elif case == "chunk on blocks of 16":
        segments, block = [(2, 20, (1, 2))], 16
    elif case == "causal rows without a key":
        segments, causal = [(3, 2, (1,))], True
    elif case == "head dim 24":
        kwargs = {"d": 24}
    elif case == "gqa repeat":
        backend = NPUOnCPU(gqa="repeat")
    elif case == "capturing":
        fake.capturing = True
        monkeypatch.setattr(paged, "read_lengths", lambda *a: pytest.fail("read the lengths on the host"))
    elif case == "an entry reading more blocks than the pool":
        segments, kwargs = [(1, 600, (0, 1, 2, 3, 0))], {"blocks": 4}
    args = list(_problem(segments, block, **kwargs))
    if case == "values in keys":
        args[2] = args[1][..., :16]
    return backend, args, causal


@pytest.mark.parametrize(
    "case",
    ["float32", "chunk on blocks of 16", "causal rows without a key", "head dim 24", "gqa repeat", "capturing",
     "values in keys", "an entry reading more blocks than the pool"],
)  # fmt: skip
def test_calls_the_op_does_not_take_go_to_the_gather(fake, monkeypatch, case):
    """What the page refuses (float32; several queries on blocks other than 128..512; head dims not a multiple of 16
    there; values of another shape than the keys; an entry reading more blocks than the pool holds), what xcp keeps off
    the op (rows that see no key; repeated K/V would copy the pool) and graph capture (host lengths) run the base
    class's gather instead: no op call, the same result."""
    backend, args, causal = _fallback(case, monkeypatch, fake)
    served_pools = ("causal rows without a key", "capturing", "an entry reading more blocks than the pool")
    assert not backend.paged_in_place(*args[:3]) or case in served_pools
    out, lse = backend.forward_paged(*args, 0.2, causal)
    want_out, want_lse = Backend.forward_paged(backend, *args, 0.2, causal)
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert fake.infer_calls == []


SHARED = [(1, 300, (0, 1, 2)), (2, 300, (0, 1, 2)), (1, 100, (3,)), (3, 200, (0, 1))]
"""Segments of one sequence sharing its blocks (a chunk's groups of queries on a rank of an interleaved world),
reading 3 + 3 + 1 + 2 blocks of a pool of 4."""


@pytest.mark.parametrize("causal", [False, True])
def test_entries_reading_more_blocks_than_the_pool_are_cut_into_calls(fake, causal):
    """The op needs a pool of at least the blocks its entries read together: the entries are cut, in order, into as
    few calls as keep each within the pool, each reading it in place (a call of one-query entries takes the decode
    branch); exact."""
    args = _problem(SHARED, 128, blocks=4)
    out, lse = NPUOnCPU().forward_paged(*args, 0.2, causal)
    _assert_matches(out, lse, *_reference(args[0], args[1], args[2], SHARED, causal, 0.2), args[0])
    sparse = 3 if causal else 0
    assert fake.infer_calls == [(1, None, [300], 2, 0, 128), (2, [2, 1], [300, 100], 2, sparse, 128),
                                (3, [3], [200], 2, sparse, 128)]  # fmt: skip


def test_paged_in_place_names_the_pools_the_op_reads(fake):
    q, k, v = _problem(CHUNKS, 128)[:3]
    assert NPUOnCPU().paged_in_place(q, k, v)
    assert NPUOnCPU().paged_in_place(q, k[:, :, :1].contiguous(), v[:, :, :1].contiguous())  # 8 query heads on 1
    wide_q = _rand(3, 128, 32)
    assert not NPUOnCPU().paged_in_place(wide_q, k[:, :, :1].contiguous(), v[:, :, :1].contiguous())  # 128 > 64 a group
    q16, k16, v16 = _problem(DECODE, 16)[:3]
    assert not NPUOnCPU().paged_in_place(q16, k16, v16)  # decode rows only: chunks would gather
    assert paged.pool_unsupported(q16, k16, v16) is None
    assert "block size 48" in paged.prompt_unsupported(48, 32)
    assert "block size 24" in paged.pool_unsupported(*_problem(DECODE, 24)[:3])


def test_torch_npu_6_names_the_scale_scale_value(monkeypatch):
    """torch_npu 6.0's op takes ``scale_value`` (7.0's ``scale``): read from the op's schema or signature."""
    old = FakeTorchNPU6()
    monkeypatch.setitem(sys.modules, "torch_npu", old)
    assert paged.scale_keyword(old.npu_fused_infer_attention_score) == "scale_value"
    assert paged.scale_keyword(FakeTorchNPU().npu_fused_infer_attention_score) == "scale"
    assert {"self", "other", "alpha"} <= paged.argument_names(torch.ops.aten.add)  # a torch op: from its schema
    args = _problem(DECODE, 16)
    out, lse = NPUOnCPU().forward_paged(*args, 0.2)
    _assert_matches(out, lse, *_reference(args[0], args[1], args[2], DECODE, False, 0.2), args[0])
    assert len(old.infer_calls) == 1


def test_an_op_that_returns_no_lse_is_named(fake, monkeypatch):
    op = fake.npu_fused_infer_attention_score
    monkeypatch.setattr(fake, "npu_fused_infer_attention_score", lambda *a, **k: (op(*a, **k)[0], torch.zeros(1)))
    with pytest.raises(ValueError, match=r"softmax_lse: expected float32 \(3, 8, 1, 1\) \(softmax_lse_flag=True"):
        NPUOnCPU().forward_paged(*_problem(DECODE, 16), 0.2)


def test_the_stand_in_refuses_what_the_page_refuses(fake):
    """Direct calls the op's page refuses raise, so a backend that made them would fail these tests."""
    q, k, v = (torch.zeros(2, 2, 4, 16, dtype=torch.float16), *(torch.zeros(4, 128, 32, dtype=torch.float16),) * 2)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    ok = {"block_table": table, "actual_seq_lengths": [2, 1], "actual_seq_lengths_kv": [130, 5], "num_heads": 4,
          "num_key_value_heads": 2, "input_layout": "BSND", "block_size": 128, "softmax_lse_flag": True}  # fmt: skip
    out, lse = fake.npu_fused_infer_attention_score(q, k, v, **ok)
    assert out[1, 1].isnan().all() and not out[1, 0].isnan().any()  # a padded query row: never to be read
    bad = [
        ((q.float(), k.float(), v.float()), {}),  # float32
        ((q, k, v[..., :16].contiguous()), {}),  # value of another shape
        ((q, k, v), {"actual_seq_lengths_kv": [0, 5]}),  # an entry without keys
        ((q, k, v), {"actual_seq_lengths": [3, 1]}),  # more queries than Q_S
        ((q, k, v), {"actual_seq_lengths_kv": [300, 5]}),  # 3 blocks: past the table
        ((q, k, v), {"num_key_value_heads": 0}),  # 4 K/V heads of D 8 in rows of 32: not q's D
        ((q, k.view(8, 64, 32), v.view(8, 64, 32)), {"block_size": 64}),  # Q_S 2 on blocks of 64
        ((torch.zeros(2, 2, 4, 8, dtype=torch.float16), k[..., :16].contiguous(), v[..., :16].contiguous()), {}),
    ]
    for tensors, change in bad:  # the last: D 8 with Q_S 2 (16-aligned needed)
        with pytest.raises(RuntimeError):
            fake.npu_fused_infer_attention_score(*tensors, **{**ok, **change})
    wide_q = torch.zeros(1, 1, 128, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="heads 128/1"):  # 128 query heads on one K/V head: above 64 a group
        one = torch.zeros(2, 16, 16, dtype=torch.float16)
        fake.npu_fused_infer_attention_score(wide_q, one, one, **{**ok, "block_table": table[:1, :1],
                                             "actual_seq_lengths": None, "actual_seq_lengths_kv": [3],
                                             "num_heads": 128, "num_key_value_heads": 1, "block_size": 16})  # fmt: skip
    with pytest.raises(RuntimeError, match="Q_S 1: block_size 8"):
        q1, k8 = q[:, :1].contiguous(), torch.zeros(16, 8, 32, dtype=torch.float16)
        fake.npu_fused_infer_attention_score(q1, k8, k8, **{**ok, "block_size": 8, "actual_seq_lengths": None,
                                                            "actual_seq_lengths_kv": [5, 5]})  # fmt: skip
    fake.capturing = True
    with pytest.raises(RuntimeError, match="capturing"):
        fake.npu_fused_infer_attention_score(q, k, v, **ok)


# ---------------------------------------------------------------------------------------------- PagedKVCache
STEPS = [  # (sequence, new tokens) of each step: prefill chunks beside decode rows, a sequence leaving
    [("a", 150), ("b", 40)],
    [("a", 1), ("b", 30), ("c", 7)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("b", 1), ("c", 120)],
]


def test_paged_cache_over_ranks_reads_its_pool_through_the_op(fake, monkeypatch):
    """xcp.PagedKVCache on the ``npu-glue`` backend over 2 virtual ranks, float16, blocks of 128 rows: every step's
    output equals float64 attention over each sequence's whole history; no sequence's rows are gathered, neither by
    the cache nor by the base class (every call is a prefix: chunks through sparse_mode 3 or as groups of queries over
    one prefix, cut into calls within the pool, decode rows one query per entry)."""
    from xcp.inference.paged import PagedKVCache

    monkeypatch.setattr(PagedKVCache, "_rows", lambda self, seq: pytest.fail("gathered a sequence's rows"))
    monkeypatch.setattr(Backend, "forward_paged", lambda *a, **k: pytest.fail("the base class's gather ran"))
    h, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(7)
    data = {s: [torch.randn(400, n, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv)] for s in "abc"}

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=6, block_size=128, device="npu-glue")
        lengths, outs = {}, []
        for step in STEPS:
            ids = [s for s, _ in step]
            spans = [(lengths.get(s, 0), lengths.get(s, 0) + n) for s, n in step]
            q, k, v = (torch.cat([data[s][i][a:b] for s, (a, b) in zip(ids, spans)]).half() for i in range(3))
            cu = torch.tensor([0, *torch.tensor([n for _, n in step]).cumsum(0).tolist()])
            cache.append(ids, k, v, cu)
            lengths.update({s: b for s, (_, b) in zip(ids, spans)})
            outs.append(cache.attention(q, ids, cu))
        return outs

    with installed(NPUGlueOnCPU()), LocalWorld(2) as world:
        results = world.run(rank)
    lengths: dict[str, int] = {}
    for i, step in enumerate(STEPS):
        rows = []
        for s, n in step:
            end = lengths[s] = lengths.get(s, 0) + n
            q, k, v = (x[:end].half().double() for x in data[s])
            scores = torch.einsum("thd,shd->hts", q[end - n :], k.repeat_interleave(h // hkv, 1)) / math.sqrt(d)
            scores = scores.masked_fill(torch.arange(end)[None] > torch.arange(end - n, end)[:, None], NEG_INF)
            rows.append(torch.einsum("hts,shd->thd", torch.softmax(scores, -1), v.repeat_interleave(h // hkv, 1)))
        want = torch.cat(rows)
        for outs in results:
            assert_close_to(f"step {i}", outs[i], want, TOL)
    branches = {call[0] > 1 for call in fake.infer_calls}
    assert branches == {True, False}  # chunks (Q_S > 1) and decode rows (Q_S 1) both through the op


@pytest.mark.parametrize("capturing", [False, True])
def test_paged_decode_steps_on_blocks_of_16(fake, capturing):
    """xcp.PagedDecode over 2 virtual ranks on ``npu-glue``, float16, blocks of 16 rows: 3 requests (prompts of 20,
    5, 33 tokens) decode 4 steps, one leaving after 2, a batch of 3 padded to 4 (a padded row sees no key: left out
    of the call, exactly 0). Eager, every step is one op call of the decode branch (Q_S 1) reading the pool in place;
    with the stream reported as captured (the op's host lengths would be frozen) the base class's gather runs, never
    the op. Outputs equal float64 attention over each request's history."""
    h, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(5)
    data = [[torch.randn(40, n, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv)] for _ in range(3)]
    prompts = [20, 5, 33]
    steps = [[0, 1, 2], [2, 0, 1], [0, 2], [2, 0]]

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=12, block_size=16, device="npu-glue")
        cu = torch.tensor([0, *torch.tensor(prompts).cumsum(0).tolist()])
        cache.append([0, 1, 2], *(torch.cat([x[j][:n] for x, n in zip(data, prompts)]).half() for j in (1, 2)), cu)
        decode = PagedDecode(cache, max_batch=4, max_len=40)
        lengths, outs = list(prompts), []
        for ids in steps:
            batch = decode.plan(ids)
            fake.capturing = capturing  # (this rank's thread) a captured step: the op refuses any call
            q, k, v = decode_padding(batch, *(torch.stack([data[i][j][lengths[i]] for i in ids]).half()
                                              for j in range(3)))  # fmt: skip
            out = decode.step(q, k, v)
            fake.capturing = False
            assert out.shape == (batch, h, d) and (out[len(ids) :] == 0).all() and not out.isnan().any()
            outs.append(out[: len(ids)])
            for i in ids:
                lengths[i] += 1
            if ids == [2, 0, 1]:
                cache.free(1)
        return outs

    with installed(NPUGlueOnCPU()), LocalWorld(2) as world:
        results = world.run(rank)
    lengths = list(prompts)
    for n, ids in enumerate(steps):
        rows = []
        for i in ids:
            end = lengths[i] = lengths[i] + 1
            q, k, v = (x[:end].half().double() for x in data[i])
            p = torch.softmax(torch.einsum("hd,shd->hs", q[end - 1], k.repeat_interleave(h // hkv, 1)) / d**0.5, -1)
            rows.append(torch.einsum("hs,shd->hd", p, v.repeat_interleave(h // hkv, 1)))
        for outs in results:
            assert_close_to(f"step {n}", outs[n], torch.stack(rows), TOL)
    if capturing:
        assert fake.infer_calls == []
    else:
        assert len(fake.infer_calls) == 2 * len(steps) and {(c[0], c[5]) for c in fake.infer_calls} == {(1, 16)}


# ---------------------------------------------------------------------------------------------- the combine
@pytest.mark.parametrize("dropped", [False, True])
def test_serving_combine_on_npu_streams_hands_the_partial_over_by_clone(fake, monkeypatch, dropped):
    """A serving workload over 3 virtual ranks of PagedKVCache on NPUBackend's kernels (the stand-in) and hand-off
    policy, with the simulated device's streams, under the lifetime sanitizer: the combine hands every packed partial
    to the comm stream by ``clone`` (NPUBackend's policy: no ``handoff`` given) and nothing is found; with the
    hand-off dropped (the comm stream reading without waiting) the sanitizer reports the all-gather's race. Outputs
    equal float64 attention."""
    policies: list[str] = []
    real = lifetime.hand_off
    monkeypatch.setattr(lifetime, "hand_off", lambda b, t, c, p: policies.append(p) or real(b, t, c, p))
    if dropped:
        monkeypatch.setattr(lifetime.RingCall, "hand_to_comm", lambda self, tensors, channel, ordered=False: tensors)
    report = sanitize_serve(requests=4, world=3, dtype=torch.float16, head_dim=16, block_size=128, backend=NPUOnSim)
    assert report.config["handoff"] == "clone" and report.max_error["out"] < TOL
    assert fake.infer_calls  # the partials came from the op
    if not dropped:
        assert report.ok and set(policies) == {"clone"}, report.format()
    else:
        races = [f for f in report.findings if f.kind == "race"]
        assert any(any("p2p combine" in a.op for a in f.accesses) for f in races), report.format()


# ---------------------------------------------------------------------------------------------- on Ascend hardware
def test_device_forward_paged():
    """On an NPU: forward_paged of decode rows (blocks of 16 and 128) and of chunks (blocks of 128, causal and not)
    against the base class's gather on the same device. Settles the op's lse, its per-entry bottom-right alignment
    of sparse_mode 3 and the (blocknum, blocksize, H) pool reading on hardware."""
    probe = NPUBackend()
    ok, reason = probe.available()
    if not ok:
        pytest.skip(f"needs torch_npu ({reason})")
    errors = {}
    for name, segments, block in [("decode16", DECODE, 16), ("decode128", DECODE[:2], 128), ("chunks", CHUNKS, 128)]:
        for causal in (False, True):
            args = [x.to("npu") if isinstance(x, torch.Tensor) else x for x in _problem(segments, block, d=128)]
            out, lse = probe.forward_paged(*args, 128**-0.5, causal)
            ref_out, ref_lse = Backend.forward_paged(probe, *args, 128**-0.5, causal)
            finite = ref_lse.isfinite()
            assert torch.equal(lse.isfinite(), finite) and not out.isnan().any()
            errors[name, causal] = max(
                (lse[finite] - ref_lse[finite]).abs().max().item(),
                (out.float() - ref_out.float()).abs().max().item() / max(1.0, ref_out.float().abs().max().item()),
            )
    assert max(errors.values()) < 4e-2, f"forward_paged does not match the gather: {errors}"
