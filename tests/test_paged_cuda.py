"""Paged, ragged decode on a real CUDA device: the flash op's paged form, xcp.PagedDecode captured per padded
batch size and replayed against the same steps run eagerly, the allocator's counts, PyTorch's CUDA sanitizer on
the combine. The workload and the float64 reference are tests/test_paged_decode.py's."""

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

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_TOL = 2e-2  # relative, against float64: a bf16 output rounded once, its inputs too


def run_paged_world(world, steps, graphs, seed=0, max_batch=8, max_len=700, block=256, handoff=None, device="cuda"):
    """Requests joining (prompts of up to 400 tokens), decoding and leaving over ``world`` virtual ranks of one
    GPU, bf16, blocks of ``block`` rows. With ``graphs`` each padded size is run eagerly once, captured at its
    next step (one graph holding every rank's work) and replayed after. Returns every rank's outputs of every
    step (on the CPU), the padded rows' largest magnitude, and for each replayed step the device allocations its
    replay made and the change of the allocated bytes across it."""
    backend = xcp.get_backend(device)
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


def test_replayed_ragged_decode_equals_eager_and_float64_and_allocates_nothing():
    """200 steps over 4 virtual ranks with requests joining and leaving: every replayed step equals the same
    step run eagerly (the same kernels on the same inputs), holds against float64, makes no device allocation
    in its replay and leaves the allocated bytes as they were; padded rows are 0."""
    eager, pad_eager, _, plan = run_paged_world(4, 200, graphs=False)
    replayed, pad_replayed, replays, _ = run_paged_world(4, 200, graphs=True)
    assert len(replays) > 150  # most steps replay a captured graph
    assert all(counts == (0, 0) for counts in replays), replays[:10]
    assert pad_eager == 0.0 and pad_replayed == 0.0
    tokens = _tokens(len({i for _, join, _ in plan for i, _ in join}), 700, 0)
    wants = _reference([[x.to(torch.bfloat16).double() for x in t] for t in tokens], plan, 700)
    for step, (e, r, want) in enumerate(zip(eager, replayed, wants)):
        for a, b in zip(e, r):
            assert torch.equal(a, b), f"step {step}: replayed differs from eager"
        assert max(_rel(o, want) for o in r) < BF16_TOL, f"step {step}"


def test_paged_attention_reads_the_pool_in_place_on_cuda(monkeypatch):
    """A chunk beside decodes through PagedKVCache.attention over 2 ranks with blocks of 256 rows: no sequence's
    rows gathered (the flash paged form reads the pool), against float64."""
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
