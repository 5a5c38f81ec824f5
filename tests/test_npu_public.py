"""xcp_npu through the public entry points, on a CPU stand-in of torch_npu as strict as its sources
(tests/npu_standin.py): xcp.attention over a LocalWorld, xcp.KVCache and the transformers drop-in, against float64
attention of the whole sequence; the limits the sources state (query heads, the TND grad's head dim, graph capture);
HCCL's bounded waits.

The stand-in computes in float32, as the device does, so results compare to float64 within float32 rounding: 2e-5 of
max(1, max|ref|) (about a hundred ulps of the largest value: the merges and sums over a few hundred terms), far below
what a wrong mask, head mapping, split or lse would give (O(0.1)). The backend is registered as ``npu-glue``:
NPUBackend's kernels, dtypes and value_head_dims, with the CPU's no-op streams.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from helpers import independent_masked_reference, installed
from npu_standin import FakeTorchNPU, NPUGlueOnCPU, public_attention
from strategies import assert_close_to

import xcp
from xcp.backends.base import Backend
from xcp.cli import main
from xcp.comm.dist import DistCommunicator
from xcp.comm.protocol import CommTimeout
from xcp_npu import NPUBackend, convert
from xcp_npu.backend import CAPTURE_REFUSED

TOL = 2e-5
NAMES = ("out", "dq", "dk", "dv")


@pytest.fixture
def npu(monkeypatch):
    """(the stand-in, the registered ``npu-glue`` backend); unregistered after the test."""
    fake = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    with installed(NPUGlueOnCPU()) as backend:
        yield fake, backend


def _inputs(s, h, hkv, dqk, dv, seed=0):
    """float32 q [1, s, h, dqk], k [1, s, hkv, dqk], v [1, s, hkv, dv], dout [1, s, h, dv]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, n, d, generator=g) for n, d in ((h, dqk), (hkv, dqk), (hkv, dv), (h, dv))]


def _called(dqk, dv):
    """(Dq, Dk, Dv) of the op's calls: as given when Dv <= Dqk, q and k zero-padded to Dv otherwise."""
    return max(dqk, dv), max(dqk, dv), dv


# ---------------------------------------------------------------------------------------------- values of another dim
MLA_CASES = [  # (dqk, dv, heads, kv heads, documents, window)
    (192, 128, 4, 2, None, None),
    (64, 128, 4, 2, (0, 3, 9, 16), None),  # Dv > Dqk: q, k padded
    (576, 512, 2, 1, (0, 5, 16), None),  # absorbed MLA: TND forward, per-segment BSND grads (TND grad D <= 512)
    (192, 128, 4, 2, (0, 7, 16), (3, 0)),  # a window: sparse_mode 4
]


@pytest.mark.parametrize("dqk,dv,h,hkv,cu,window", MLA_CASES, ids=str)
def test_attention_with_values_of_another_head_dim(npu, dqk, dv, h, hkv, cu, window):
    """xcp.attention over 2 virtual ranks (zigzag, causal) takes values of another head dim on npu (value_head_dims)
    and gives out, dq, dk, dv in their own dims equal to float64 attention of the whole sequence."""
    fake, _ = npu
    q, k, v, dout = _inputs(16, h, hkv, dqk, dv, seed=dqk + dv)
    documents = None if cu is None else torch.tensor(cu)
    got = public_attention(2, q, k, v, dout, causal=True, cu_seqlens=documents, window=window)
    want = independent_masked_reference(q, k, v, dout, cu or (0, 16), True, window=window)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert_close_to(name, a, b, TOL)
    assert fake.head_dims and set(fake.head_dims) == {_called(dqk, dv)}, "the op was not called with the dims"
    if cu is not None:
        assert {c[0] for c in fake.varlen_calls} == ({"fwd"} if dqk == 576 else {"fwd", "bwd"})
    if dqk == 576:
        assert any(c[0] == "bwd" for c in fake.calls), "TND grads past head dim 512 go per segment in BSND"


@pytest.mark.parametrize("capacity", [None, 32])
@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128)])
def test_kv_cache_with_values_of_another_head_dim(npu, capacity, dqk, dv):
    """xcp.KVCache(device="npu-glue") over 2 ranks: prefill, decode steps and a chunk; each step's out (in v's dim)
    equals float64 causal attention over every token so far; with a capacity the steps run forward_range."""
    fake, _ = npu
    world, ends = 2, [8, 9, 12, 13]  # a prompt of 8, then a decode step, a chunk of 3, a decode step
    q, k, v, _ = _inputs(ends[-1], 4, 2, dqk, dv, seed=3)

    def rank(group):
        cache = xcp.KVCache(group=group, capacity=capacity, device="npu-glue")
        cache.prefill(xcp.shard(k[:, : ends[0]], world, group.rank()), xcp.shard(v[:, : ends[0]], world, group.rank()))
        return [cache.append(k[:, a:b], v[:, a:b]) or cache.attention(q[:, a:b]) for a, b in zip(ends, ends[1:])]

    results = xcp.LocalWorld(world).run(rank)
    for i, (a, b) in enumerate(zip(ends, ends[1:])):
        dout = torch.zeros(1, b, 4, dv)
        want = independent_masked_reference(q[:, :b], k[:, :b], v[:, :b], dout, (0, b), True)[0][:, a:]
        for outs in results:
            assert_close_to(f"step {i}", outs[i], want, TOL)
    assert fake.head_dims and set(fake.head_dims) == {_called(dqk, dv)}
    assert fake.varlen_calls, "the cache's steps did not reach the TND op"


def test_transformers_drop_in_with_mla(npu, monkeypatch):
    """DeepSeek-V3 (q/k head dim 12, v 6) with attn_implementation="xcp" over 2 virtual ranks, its attention on npu:
    logits, loss and every gradient equal the same float32 model's eager attention on one device. The drop-in picks
    the backend from the tensors' device type; here that pick is redirected to ``npu-glue`` (CPU tensors), the one
    change to the public path."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.deepseek_v3")
    from xcp.integrations import transformers as xt

    fake, _ = npu
    chosen = xcp.api.select_backend
    monkeypatch.setattr(xcp.api, "select_backend", lambda device, kind: chosen(device or "npu-glue", kind))
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1, max_position_embeddings=64, num_mtp_layers=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").train()
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    models = [copy.deepcopy(model) for _ in range(2)]  # copied before the reference's backward: no gradients yet
    ref = model(input_ids=ids, labels=ids, use_cache=False)
    ref.loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    xt.register()
    for m in models:
        xt.prepare(m).set_attn_implementation("xcp")

    def rank(group):
        with xcp.context(group):
            out = models[group.rank()](**xt.shard_batch(ids, labels=ids).model_kwargs())
        out.loss.backward()  # the ring's backward holds its group: no context needed
        return out.logits.detach(), out.loss.detach()

    results = xcp.LocalWorld(2).run(rank)
    assert set(fake.head_dims) == {(12, 12, 6)}, "the attention did not run on the npu backend"
    assert_close_to("logits", xcp.unshard([r[0] for r in results]), ref.logits.detach(), 1e-4)
    assert_close_to("loss", sum(r[1] for r in results), ref.loss.detach(), 1e-4)
    for name, want in ref_grads.items():
        assert_close_to(name, sum(dict(m.named_parameters())[name].grad for m in models), want, 1e-4)


# ---------------------------------------------------------------------------------------------- query heads
@pytest.mark.parametrize("h,hkv,cu", [(300, 3, (0, 3, 8)), (520, 1, None), (512, 8, None)], ids=str)
def test_more_than_256_query_heads(npu, h, hkv, cu):
    """The op takes 1..256 query heads: xcp.attention with more (GQA groups of 100, one group of 520 split in four
    parts reading one K/V head, groups of 64) runs calls of at most 256 heads and equals float64 attention."""
    fake, _ = npu
    q, k, v, dout = _inputs(8, h, hkv, 8, 8, seed=h)
    documents = None if cu is None else torch.tensor(cu)
    got = public_attention(2, q, k, v, dout, causal=True, cu_seqlens=documents)
    want = independent_masked_reference(q, k, v, dout, cu or (0, 8), True)
    for name, a, b in zip(NAMES, got, want):
        assert_close_to(name, a, b, TOL)
    assert fake.head_nums and max(fake.head_nums) <= 256
    assert sum(n for n in fake.head_nums) > h  # more than one call covered the heads


def test_head_chunks_keep_gqa_groups_together():
    assert convert.head_chunks(256, 8) == [(slice(0, 256), slice(0, 8))]
    assert convert.head_chunks(512, 8) == [(slice(0, 256), slice(0, 4)), (slice(256, 512), slice(4, 8))]
    assert convert.head_chunks(300, 3) == [(slice(0, 100), slice(0, 1)), (slice(100, 300), slice(1, 3))]
    assert convert.head_chunks(520, 1) == [(slice(h, h + 130), slice(0, 1)) for h in range(0, 520, 130)]
    for h, hkv in [(257, 1), (384, 128), (1024, 16), (768, 3), (510, 2)]:
        chunks = convert.head_chunks(h, hkv)
        group = h // hkv
        covered = [i for hq, _ in chunks for i in range(hq.start, hq.stop)]
        assert covered == list(range(h)) and all(hq.stop - hq.start <= 256 for hq, _ in chunks)
        for hq, hk in chunks:  # every query head of a chunk reads a K/V head of that chunk
            assert all(hk.start <= i // group < hk.stop for i in range(hq.start, hq.stop))
    with pytest.raises(ValueError, match="kv_heads: expected a divisor of heads = 6; got 4"):
        convert.head_chunks(6, 4)


# ---------------------------------------------------------------------------------------------- the stand-in's refusals
def test_stand_in_refuses_what_the_sources_refuse():
    """float64, more than 256 query heads, a TND grad past head dim 512, a segment without keys, a call while
    capturing: each a RuntimeError (or an assertion), so a backend that sent one would fail the tests above."""
    fake = FakeTorchNPU()
    x = torch.zeros(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match="dtypes torch.float64"):
        fake.npu_fusion_attention(x.double(), x.double(), x.double(), 2, "BSND")
    many = torch.zeros(1, 4, 257, 16)
    with pytest.raises(RuntimeError, match="Nq must be in 1..256"):
        fake.npu_fusion_attention(many, many, many, 257, "BSND")
    t = torch.zeros(4, 2, 576)
    stats = torch.zeros(4, 2, 8)
    with pytest.raises(RuntimeError, match=r"D must be in 1..512"):
        fake.npu_fusion_attention_grad(t, t, t[..., :512].contiguous(), t[..., :512].contiguous(), 2, "TND",
                                       softmax_max=stats, softmax_sum=stats, attention_in=t[..., :512].contiguous(),
                                       actual_seq_qlen=[4], actual_seq_kvlen=[4])  # fmt: skip
    t = torch.zeros(4, 2, 16)
    fake.npu_fusion_attention(t, t, t, 2, "TND", actual_seq_qlen=[0, 4], actual_seq_kvlen=[2, 4])  # no queries: allowed
    with pytest.raises(AssertionError, match="a segment without keys"):
        fake.npu_fusion_attention(t, t, t, 2, "TND", actual_seq_qlen=[2, 4], actual_seq_kvlen=[0, 4])
    fake.capturing = True
    with pytest.raises(RuntimeError, match="does not support graph mode"):
        fake.npu_fusion_attention(x, x, x, 2, "BSND")


# ---------------------------------------------------------------------------------------------- graph capture
def test_graph_capture_is_refused(npu, capsys):
    """The op does not support aclgraph: no graph from the tool hooks, xcp bench --replay refused, and an attention
    called while the stream is captured raises a clear RuntimeError before any op call."""
    fake, backend = npu
    assert NPUBackend().new_graph() is None and backend.new_graph() is None
    with pytest.raises(RuntimeError, match="cannot be captured into an NPU graph"):
        backend.capture_graph(object())
    argv = ["bench", "--device", "npu-glue", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--seqs", "16",
            "--worlds", "2", "--quiet", "--no-graph", "--replay"]  # fmt: skip
    assert main(argv) == 2
    assert "--replay: needs a backend with device graphs" in capsys.readouterr().err
    q, k, v, _ = _inputs(8, 2, 1, 16, 16)
    fake.capturing = True
    with pytest.raises(RuntimeError, match="cannot be captured") as err:
        xcp.attention(q, k, v, device="npu-glue")
    assert str(err.value) == CAPTURE_REFUSED
    assert fake.calls == [] and fake.varlen_calls == []


# ---------------------------------------------------------------------------------------------- HCCL waits
class _NeverDone:
    """A work object that never completes and whose wait(timeout) returns at once, as WorkHCCL's does without
    TORCH_HCCL_BLOCKING_WAIT=1."""

    def __init__(self):
        self.waits = []

    def is_completed(self):
        return False

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True


class _FakeDist:
    """The torch.distributed calls DistCommunicator.exchange makes, handing out never-completing work."""

    def __init__(self):
        self.work = _NeverDone()

    @staticmethod
    def P2POp(*args):  # noqa: N802 - torch.distributed's name
        return args

    isend = irecv = object()

    def batch_isend_irecv(self, ops):
        return [self.work]


def _communicator(timeout):
    comm = DistCommunicator.__new__(DistCommunicator)  # a group of 2 without a process group to build it from
    comm._dist, comm.group, comm._size, comm._rank, comm._global = _FakeDist(), None, 2, 0, [0, 1]
    comm.timeout = timeout
    return comm


def test_hccl_wait_is_bounded_by_polling():
    """HCCL's work.wait(timeout) returns without raising when the timeout passes; NPUBackend declares
    poll_comm_waits, so a bounded wait polls is_completed() and raises CommTimeout naming the rank, the peer, the step
    and the channel. A backend that does not poll passes the timeout to wait() and trusts it to raise."""
    x = torch.zeros(4)
    comm = _communicator(0.05)
    work = comm.exchange([(x, 1)], [(torch.zeros(4), 1)], "kv", NPUBackend(), step=3)
    with pytest.raises(CommTimeout, match=r"xcp: rank 0 sending kv0 to rank 1 at step 3: no progress within 0.05 s"):
        work.wait()
    assert comm._dist.work.waits == [], "a polled wait never calls wait() on an unfinished work"
    comm = _communicator(0.05)
    comm.exchange([(x, 1)], [], "kv", Backend(), step=0).wait()  # the base class trusts wait(timeout)
    assert len(comm._dist.work.waits) == 1 and comm._dist.work.waits[0].total_seconds() <= 0.05
