"""Paged, ragged decode on a real CUDA device: the flash op's paged form and xcp's Triton paged decode against
float64, xcp.PagedDecode captured per padded batch size and replayed against the same steps run eagerly, the
allocator's counts, PyTorch's CUDA sanitizer on the combine. The workload and the float64 reference are
tests/test_paged_decode.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_paged_decode import _reference, _tokens, _workload

import xcp
from xcp.cli.bench.serve import Ranks
from xcp.inference.paged import PagedKVCache
from xcp.inference.paged_decode import decode_padding
from xcp_cuda import CUDABackend, kernels
from xcp_cuda import paged as cuda_paged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_TOL = 2e-2  # relative, against float64: a bf16 output rounded once, its inputs too


def run_paged_world(
    world, steps, graphs, seed=0, max_batch=8, max_len=700, block=256, handoff=None, device="cuda", backend=None
):
    """Requests joining (prompts of up to 400 tokens), decoding and leaving over ``world`` virtual ranks of one
    GPU, bf16, blocks of ``block`` rows. With ``graphs`` each padded size is run eagerly once, captured at its
    next step (one graph holding every rank's work) and replayed after. Returns every rank's outputs of every
    step (on the CPU), the padded rows' largest magnitude, and for each replayed step the device allocations its
    replay made and the change of the allocated bytes across it."""
    backend = backend or xcp.get_backend(device)
    dev = torch.device(device)
    plan, n_ids = _workload(seed, steps, max_batch, prompt_max=400)
    tokens = [[x.to(dev, torch.bfloat16) for x in t] for t in _tokens(n_ids, max_len, seed)]
    ranks = Ranks(backend, dev, world, num_blocks=4 * max_batch * (-(-max_len // block)), block=block, handoff=handoff)
    lengths, outs, padded, replays, captured, warm = {}, [], 0.0, [], {}, set()
    for leave, join, decoding in plan:
        for i in leave:
            ranks.free(i)
            del lengths[i]
        if join:
            ids, cu = [i for i, _ in join], [0]
            for _, n in join:
                cu.append(cu[-1] + n)
            ranks.append(ids, *(torch.cat([tokens[i][j][:n] for i, n in join]) for j in (1, 2)), cu)
            lengths.update(join)
        if not ranks.decodes:
            ranks.start_decoding(max_batch, max_len)
        b = ranks.plan(decoding)
        x = decode_padding(b, *(torch.stack([tokens[i][j][lengths[i]] for i in decoding]) for j in range(3)))
        if graphs and b in captured:
            graph, static, step_outs = captured[b]
            for s, new in zip(static, x):
                s.copy_(new)
            torch.cuda.synchronize()
            count, held = torch.cuda.memory_stats()["allocation.all.allocated"], torch.cuda.memory_allocated()
            graph.replay()
            torch.cuda.synchronize()
            replays.append((torch.cuda.memory_stats()["allocation.all.allocated"] - count,
                            torch.cuda.memory_allocated() - held))  # fmt: skip
        elif graphs and b in warm:
            graph = backend.new_graph()
            with backend.capture_graph(graph):
                step_outs = ranks.step(*x)
            graph.replay()
            captured[b] = (graph, x, step_outs)
        else:
            step_outs = ranks.step(*x)
            warm.add(b)
        n = len(decoding)
        outs.append([o[:n].float().cpu() for o in step_outs])
        padded = max([padded] + [o[n:].abs().max().item() for o in step_outs if b > n])
        assert not any(o.isnan().any() for o in step_outs)
        for i in decoding:
            lengths[i] += 1
    ranks.close()
    return outs, padded, replays, plan


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def _replayed_equals_eager(world, steps, block, backend=None):
    """``steps`` steps over ``world`` virtual ranks, eager and replayed: every replayed step equals the same step run
    eagerly, holds against float64, makes no device allocation in its replay and leaves the allocated bytes as they
    were; padded rows are 0. Returns how many steps replayed a captured graph."""
    eager, pad_eager, _, plan = run_paged_world(world, steps, graphs=False, block=block, backend=backend)
    replayed, pad_replayed, replays, _ = run_paged_world(world, steps, graphs=True, block=block, backend=backend)
    assert all(counts == (0, 0) for counts in replays), replays[:10]
    assert pad_eager == 0.0 and pad_replayed == 0.0
    tokens = _tokens(len({i for _, join, _ in plan for i, _ in join}), 700, 0)
    wants = _reference([[x.to(torch.bfloat16).double() for x in t] for t in tokens], plan, 700)
    for step, (e, r, want) in enumerate(zip(eager, replayed, wants)):
        for x, y in zip(e, r):
            assert torch.equal(x, y), f"step {step}: replayed differs from eager"
        assert max(_rel(o, want) for o in r) < BF16_TOL, f"step {step}"
    return len(replays)


def test_replayed_ragged_decode_equals_eager_and_float64_and_allocates_nothing():
    """200 steps over 4 virtual ranks with requests joining and leaving, blocks of 256 rows
    (``_replayed_equals_eager``); most steps replay a captured graph."""
    assert _replayed_equals_eager(4, 200, 256) > 150


def test_replayed_ragged_decode_on_blocks_of_16_equals_eager_and_float64():
    """The same over 3 virtual ranks and 60 steps with PagedKVCache's default blocks of 16 rows (flash's paged form
    refuses them: the decode steps read the pools through the Triton paged decode)."""
    shapes = ((2, 4, 16), (3, 16, 2, 16), (3, 16, 2, 16))  # q, the pools
    q_and_pools = (torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes)
    backend = CUDABackend(triton_decode="auto")  # opt-in until this test has passed on a GPU
    assert backend.paged_kernel(*q_and_pools, 1) == "triton"
    assert _replayed_equals_eager(3, 60, 16, backend=backend) > 0


def test_paged_attention_reads_the_pool_in_place_on_cuda(monkeypatch):
    """A chunk beside decodes through PagedKVCache.attention over 2 ranks with blocks of 256 rows, against float64:
    where this torch's flash op has the paged form, no sequence's rows gathered (it reads the pool); where it has
    not (torch 2.11), each sequence's rows gathered and run on the flash block kernel."""
    if kernels.flash_takes_block_table():
        monkeypatch.setattr(PagedKVCache, "_rows", lambda self, seq: pytest.fail("a sequence's rows were gathered"))
    dev = torch.device("cuda")
    tokens = [[x.to(dev, torch.bfloat16) for x in t] for t in _tokens(3, 900, 5)]

    def rank(g):
        cache = PagedKVCache(g, num_blocks=16, block_size=256)
        cache.append([0, 1, 2], *(torch.cat([tokens[i][j][:n] for i, n in ((0, 600), (1, 300), (2, 5))])
                                  for j in (1, 2)), [0, 600, 900, 905])  # fmt: skip
        ids, cu = [1, 0, 2], [0, 200, 201, 202]  # 200 tokens of request 1's prompt beside two decodes
        new = ((1, 300, 200), (0, 600, 1), (2, 5, 1))
        cache.append(ids, *(torch.cat([tokens[i][j][s : s + t] for i, s, t in new]) for j in (1, 2)), cu)
        q = torch.cat([tokens[i][0][s : s + t] for i, s, t in new])
        return cache.attention(q, ids, cu).float().cpu()

    results = xcp.LocalWorld(2, device="cuda").run(rank)
    wants = []
    for i, n, t in ((1, 500, 200), (0, 601, 1), (2, 6, 1)):
        q, k, v = (x[:n].cpu().double() for x in tokens[i])
        k, v = (x.repeat_interleave(2, 1).transpose(0, 1) for x in (k, v))
        mask = torch.arange(n)[None] <= torch.arange(n - t, n)[:, None]
        wants.append(torch.nn.functional.scaled_dot_product_attention(q[n - t :].transpose(0, 1), k, v,
                                                                      attn_mask=mask).transpose(0, 1))  # fmt: skip
    want = torch.cat(wants)
    for out in results:
        assert _rel(out, want) < BF16_TOL


CSAN_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    import xcp, test_paged_cuda as t
    from test_lifetime_cuda import sanitize_every_rank
    from xcp.lifetime import RingCall
    handoff, variant = sys.argv[1], sys.argv[2]
    if variant == "mutant":  # the combine's hand-off dropped: the comm stream reads the partial unordered
        RingCall.hand_to_comm = lambda self, tensors, channel, ordered=False: list(tensors)
    sanitize_every_rank()
    outs, padded, _, _ = t.run_paged_world(3, 8, graphs=False, handoff=handoff, max_batch=3, max_len=420)
    print("clean paged", len(outs), padded)
    """
)


def csan(handoff, variant):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = CSAN_SCRIPT.format(root=root, tests=os.path.join(root, "tests"))
    return subprocess.run([sys.executable, "-c", script, handoff, variant], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.parametrize("handoff", ["record_stream", "clone"])
def test_pytorch_cuda_sanitizer_reports_nothing_in_the_paged_combine(handoff):
    """8 ragged decode steps over 3 virtual ranks under CSAN (eager): the packed partial written on each rank's
    stream and gathered on its comm stream, the pool's slots written and read, without a race."""
    done = csan(handoff, "correct")
    assert done.returncode == 0 and "clean paged 8 0.0" in done.stdout, done.stdout + done.stderr
    assert "CSAN detected a possible data race" not in done.stderr


def test_pytorch_cuda_sanitizer_sees_the_paged_combine_without_its_hand_off():
    done = csan("record_stream", "mutant")
    assert done.returncode != 0
    report = done.stderr
    assert "CSAN detected a possible data race" in report, done.stdout + report
    assert "/xcp/" in report.split("Previous access")[0]


# ---------------------------------------------------------------------------------------------- Triton paged decode
DECODE_LENGTHS = [0, 1, 15, 16, 17, 255, 257, 4096, 9000, 40000]  # lengths of the target's long tail, cut down


def _tables(segments, block, n_blocks, width, g):
    """Each segment's blocks drawn shuffled from a pool of ``n_blocks`` (the spare ones fill the rows' ends): the
    int32 table [B, width], cu_q and seqused_k on the device."""
    order = torch.randperm(n_blocks, generator=g, device="cuda").to(torch.int32)
    table = torch.full((len(segments), width), int(order[-1]), dtype=torch.int32, device="cuda")
    at = 0
    for i, (_, keys) in enumerate(segments):
        count = -(-keys // block)
        table[i, :count] = order[at : at + count]
        at += count
    assert at < n_blocks
    cu = torch.tensor([0] + [sum(nq for nq, _ in segments[: i + 1]) for i in range(len(segments))],
                      dtype=torch.int32, device="cuda")  # fmt: skip
    return table, cu, torch.tensor([n for _, n in segments], dtype=torch.int32, device="cuda")


def _decode_batch(block, lengths, seed, h=32, hkv=8, d=128, dtype=torch.bfloat16):
    """The target's decode shapes (32/8 heads, D 128, bf16): one query per segment but one segment without a
    query (its keys 300), the pool random with spare blocks, the tables shuffled."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    segments = [(1, n) for n in lengths] + [(0, 300)]
    need = [-(-n // block) for _, n in segments]
    n_blocks = sum(need) + 4
    q = torch.randn(len(lengths), h, d, generator=g, device="cuda").to(dtype)
    k_pool, v_pool = (torch.randn(n_blocks, block, hkv, d, generator=g, device="cuda").to(dtype) for _ in range(2))
    return (q, k_pool, v_pool, *_tables(segments, block, n_blocks, max(need), g)), segments


def _decode_reference(q, k_pool, v_pool, table, segments, scale):
    """float64 attention of each segment's query over its rows gathered by hand (GQA by head index)."""
    h, hkv = q.shape[1], k_pool.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    row = 0
    for i, (nq, keys) in enumerate(segments):
        if nq == 0:
            continue
        if keys:
            blocks = table[i, : -(-keys // k_pool.shape[1])].long()
            k, v = (x[blocks].flatten(0, 1)[:keys].double().repeat_interleave(h // hkv, 1) for x in (k_pool, v_pool))
            s = torch.einsum("hd,khd->hk", q[row].double(), k) * scale
            lse[:, row] = torch.logsumexp(s, -1)
            out[row] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v)
        row += 1
    return out, lse


def _check_decode(out, lse, want_out, want_lse):
    blind = torch.isinf(want_lse)
    assert not out.isnan().any() and torch.equal(torch.isneginf(lse), blind)
    assert (out.transpose(0, 1)[blind] == 0).all()
    seen = ~blind.transpose(0, 1)  # [T, H]: each row against its own size (long segments' outs are small)
    err = ((out.double() - want_out).norm(dim=-1)[seen] / want_out.norm(dim=-1)[seen]).max().item()
    assert err < 2e-2, err  # bf16: the probabilities and the out rounded once each (2^-9), sums in float32
    assert (lse.double() - want_lse)[~blind].abs().max().item() < 1e-3  # float32 sums over up to 40K keys


@pytest.mark.parametrize("block", [16, 256])
def test_the_triton_paged_decode_equals_float64_on_the_target_shapes(block):
    """xcp's Triton paged decode (through CUDABackend.forward_paged, triton_decode="triton") on 32/8 heads, D 128,
    bf16, blocks of 16 and 256 rows, lengths 0 to 40000 (several splits, most segments filling few), a segment
    without a query, the table shuffled: against float64; a segment without keys out 0, lse -inf."""
    backend = CUDABackend(triton_decode="triton")
    args, segments = _decode_batch(block, DECODE_LENGTHS, seed=block)
    assert backend.paged_kernel(*args[:3], 1) == "triton"
    out, lse = backend.forward_paged(*args, 1, max(DECODE_LENGTHS), 0.088)
    _check_decode(out, lse, *_decode_reference(*args[:4], segments, 0.088))


def test_the_triton_paged_decode_replays_with_other_tables_and_lengths():
    """Captured once (max_k fixed) and replayed after the queries, the table, cu_q and the lengths changed in place
    (the segment without a query moved first, every block drawn again): each replay equals the eager call on the
    same inputs bit for bit, and float64."""
    args, _ = _decode_batch(16, DECODE_LENGTHS, seed=3)
    q, k_pool, v_pool, table, cu, used = args
    max_k = max(DECODE_LENGTHS)
    run = lambda: cuda_paged.paged_decode(q, k_pool, v_pool, table, cu, used, max_k, 0.088)  # noqa: E731
    run()  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    g = torch.Generator(device="cuda").manual_seed(7)
    for segments in ([(0, 300)] + [(1, n) for n in DECODE_LENGTHS[::-1]],
                     [(1, n) for n in (max_k, 9000, 4096, 0, 1, 2, 3, 4, 5, 6)] + [(0, 5)]):  # fmt: skip
        for x, new in zip((table, cu, used), _tables(segments, 16, k_pool.shape[0], table.shape[1], g)):
            x.copy_(new)
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        graph.replay()
        eager = run()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
        _check_decode(captured[0], captured[1], *_decode_reference(q, k_pool, v_pool, table, segments, 0.088))
