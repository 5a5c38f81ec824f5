"""xcp.recurrent over LocalWorld(P), float64, against the same kernel on the whole sequence.

Two reference kernels written here as plain per-token loops (a gated delta rule, whose T is a dense
d_k x d_k map, and a diagonal-decay linear attention), a depthwise causal convolution; P in {1, 2, 3, 4},
every balance but stripe, packed documents (some shorter than a halo): every output, the final state and
every gradient (inputs and a parameter) to 1e-10. Also the named errors.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import xcp
from xcp.recurrent import Decay, DeltaRule, causal_conv, last_inputs, plan_pieces, state_passing
from xcp.testing.recurrent_sanitizer import delta_rule as delta_kernel
from xcp.testing.recurrent_sanitizer import per_document as whole
from xcp.testing.recurrent_sanitizer import short_conv as depthwise

TOL = 1e-10
B, H, DK, DV, C, W = 2, 2, 3, 4, 5, 4


def decay_kernel(q, k, v, a, initial_state=None, output_final_state=False):
    """Diagonal decays: h <- a * h + k v^T (a per key dim); out = q^T h."""
    h = initial_state if initial_state is not None else q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        h = a[:, t, :, :, None] * h + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, None, :] @ h).squeeze(-2))
    return torch.stack(outs, 1), (h if output_final_state else None)


def decay_product(q, k, v, a):
    return a.prod(dim=1)[..., None]


def decay_carry(h, q, k, v, a):
    """What a state h entering a stretch adds to decay_kernel's outputs: q_t^T (prod_{s<=t} a_s * h)."""
    return (q.unsqueeze(-2) @ (a.cumprod(dim=1)[..., None] * h.unsqueeze(1))).squeeze(-2)


def inputs_for(kind, seq):
    gen = torch.Generator().manual_seed(seq)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if kind == "delta":
        k = F.normalize(r(B, seq, H, DK), dim=-1)
        return [r(B, seq, H, DK), k, r(B, seq, H, DV), -r(B, seq, H).abs() * 0.3, r(B, seq, H).sigmoid()]
    a = torch.rand(B, seq, H, DK, generator=gen, dtype=torch.float64)
    return [r(B, seq, H, DK), r(B, seq, H, DK), r(B, seq, H, DV), a]


def close(name, got, want, tol=TOL):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:g}"


CASES = [
    (world, balance, cu)
    for world in (1, 2, 3, 4)
    for balance, cu in (("zigzag", None), ("contiguous", None), ("zigzag", "docs"), ("document_zigzag", "docs"))
]


def documents(seq):
    return sorted({min(b, seq) for b in (0, 1, 3, 4 + seq // 3, seq - 2, seq)})


@pytest.mark.parametrize("kind", ["delta", "decay", "carry"])
@pytest.mark.parametrize(("world", "balance", "cu"), CASES, ids=[f"P{w}-{b}-{c}" for w, b, c in CASES])
def test_state_passing_matches_the_whole_sequence(kind, world, balance, cu):
    check_state_passing(kind, world, balance, cu, final_state=True)


WITHOUT_FINAL = [
    (2, "contiguous", None), (3, "zigzag", None), (3, "document_zigzag", "docs"), (3, "contiguous", "docs"),
]  # fmt: skip


@pytest.mark.parametrize("kind", ["delta", "decay", "carry"])
@pytest.mark.parametrize(("world", "balance", "cu"), WITHOUT_FINAL, ids=[f"P{w}-{b}-{c}" for w, b, c in WITHOUT_FINAL])
def test_without_the_final_state_the_last_piece_is_not_summarised(kind, world, balance, cu):
    """Pass 1 skips the last piece of the global order (its summary is never used): its owner's kernel sees
    it once (pass 2), or a one-token stretch where it holds nothing else; outputs and gradients stay exact."""
    check_state_passing(kind, world, balance, cu, final_state=False)


def check_state_passing(kind, world, balance, cu, final_state):
    seq = 8 * world if balance != "document_zigzag" else 7 * world + 3
    cu = documents(seq) if cu else [0, seq]
    inputs = inputs_for(kind, seq)
    gscale = torch.tensor(1.3, dtype=torch.float64)
    dout = torch.randn(B, seq, H, DV, dtype=torch.float64)
    dfinal = torch.randn(B, H, DK, DV, dtype=torch.float64)
    if kind == "delta":
        base, transition, kw = delta_kernel, DeltaRule(value=2), {"gscale": gscale}
    else:  # with a carry, pass 2 of a piece of one segment is pass 1's outputs plus what the entering state adds
        base, transition, kw = decay_kernel, Decay(decay_product, decay_carry if kind == "carry" else None), {}
    calls, who = {}, threading.local()  # rank -> lengths its kernel ran over (pass 1 and pass 2)

    def kernel(*args, **kwargs):
        calls.setdefault(who.rank, []).append(args[0].shape[1])
        return base(*args, **kwargs)

    ref_in = [x.clone().requires_grad_() for x in inputs]
    ref_kw = {k: t.clone().requires_grad_() for k, t in kw.items()}
    out, final = whole(lambda xs: base(*xs, output_final_state=True, **ref_kw), ref_in, cu)
    ((out * dout).sum() + (final * dfinal).sum() * final_state).backward()
    place = {"balance": balance, "cu_seqlens": cu if balance == "document_zigzag" else None}
    docs = cu if len(cu) > 2 else None

    def rank_fn(group):
        r = who.rank = group.rank()
        local = [xcp.shard(x, world, r, **place).requires_grad_() for x in inputs]
        mine = {k: t.clone().requires_grad_() for k, t in kw.items()}
        o, f = state_passing(
            kernel,
            *local,
            transition=transition,
            group=group,
            balance=balance,
            cu_seqlens=docs,
            output_final_state=final_state,
            **mine,
        )
        loss = (o * xcp.shard(dout, world, r, **place)).sum()
        if final_state and r == world - 1:  # one rank uses the final state: its gradient reaches every rank
            loss = loss + (f * dfinal).sum()
        loss.backward()
        return o.detach(), f, [x.grad for x in local], {k: t.grad for k, t in mine.items()}

    results = xcp.LocalWorld(world, timeout=30).run(rank_fn)
    close("out", xcp.unshard([res[0] for res in results], **place), out.detach())
    for res in results:
        if final_state:
            close("final state", res[1].detach(), final.detach())
        else:
            assert res[1] is None
    if not final_state:
        last = plan_pieces(seq, world, balance, cu if balance == "document_zigzag" else None)[-1]
        held = [p for p in plan_pieces(seq, world, balance, cu if balance == "document_zigzag" else None)
                if p.owner == last.owner]  # fmt: skip
        # pass 1 over each piece but the last (its last segment); pass 2 over the rest, except where the delta
        # rule's pass 1 (a piece of one segment) gave the outputs too; a rank holding only the last piece
        # learns the summaries' shapes from one token
        ran = 1 if world > 1 and held == [last] else 0
        for p in held:
            reused = p != last and kind in ("delta", "carry") and len(p.segments) == 1
            ran += (p.segments[-1][1] - p.segments[-1][0] if p != last else 0) + (0 if reused else p.stop - p.start)
        assert sum(calls[last.owner]) == ran, calls[last.owner]
    for i, x in enumerate(ref_in):
        close(f"grad of input {i}", xcp.unshard([res[2][i] for res in results], **place), x.grad)
    for name, t in ref_kw.items():
        close(f"grad of {name}", sum(res[3][name] for res in results), t.grad)


@pytest.mark.parametrize(("world", "balance", "cu"), CASES, ids=[f"P{w}-{b}-{c}" for w, b, c in CASES])
def test_causal_conv_matches_the_whole_sequence(world, balance, cu):
    seq = 4 * world if balance != "document_zigzag" else 3 * world + 2
    cu = documents(seq) if cu else [0, seq]
    x = torch.randn(B, seq, C, dtype=torch.float64)
    weight = torch.randn(C, W, dtype=torch.float64)
    dout = torch.randn(B, seq, C, dtype=torch.float64)
    rx, rw = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out, _ = whole(lambda xs: (depthwise(rw)(xs[0]), None), [rx], cu)
    (out * dout).sum().backward()
    place = {"balance": balance, "cu_seqlens": cu if balance == "document_zigzag" else None}

    def rank_fn(group):
        r = group.rank()
        local = xcp.shard(x, world, r, **place).requires_grad_()
        w = weight.clone().requires_grad_()
        y = causal_conv(depthwise(w), local, W, group=group, balance=balance, cu_seqlens=cu if len(cu) > 2 else None)
        (y * xcp.shard(dout, world, r, **place)).sum().backward()
        return y.detach(), local.grad, w.grad

    results = xcp.LocalWorld(world, timeout=30).run(rank_fn)
    close("out", xcp.unshard([res[0] for res in results], **place), out.detach())
    close("grad of x", xcp.unshard([res[1] for res in results], **place), rx.grad)
    close("grad of weight", sum(res[2] for res in results), rw.grad)


@pytest.mark.parametrize(("world", "balance"), [(2, "zigzag"), (3, "contiguous"), (4, "zigzag")])
def test_last_inputs_are_the_whole_sequences_on_every_rank(world, balance):
    """The sequence's last ``count`` inputs on every rank: fewer than a piece holds, more than the last piece
    holds (zigzag's chunks of 2 tokens), and more than the sequence (zeros before its start)."""
    seq = 4 * world
    x = torch.randn(B, C, seq, dtype=torch.float64)  # a convolution's inputs, sequence last
    for count in (1, 3, seq + 2):
        want = torch.nn.functional.pad(x, (max(count - seq, 0), 0))[..., -count:]
        results = xcp.LocalWorld(world, timeout=30).run(
            lambda group, n=count: last_inputs(xcp.shard(x, world, group.rank(), balance=balance, dim=2), n,
                                               group=group, balance=balance, seq_dim=2)
        )  # fmt: skip
        for got in results:
            assert torch.equal(got, want), count
    with pytest.raises(ValueError, match="count: expected an integer >= 1"):
        last_inputs(x, 0)
    # sequence-major at dim 1 unless told: a world of one's last inputs are its own
    y = torch.randn(B, 5, C, dtype=torch.float64)
    assert torch.equal(last_inputs(y, 2), y[:, -2:])


def test_pieces_in_global_order_with_resets():
    pieces = plan_pieces(16, 2, "zigzag", [0, 6, 16])
    assert [(p.owner, p.start, p.stop) for p in pieces] == [(0, 0, 4), (1, 4, 8), (1, 8, 12), (0, 12, 16)]
    assert [p.carries_in for p in pieces] == [False, True, True, True]
    assert [p.resets for p in pieces] == [False, True, False, False]
    assert pieces[1].segments == ((4, 6), (6, 8))


def test_stripe_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="balance: expected one of zigzag, contiguous, document_zigzag.*got 'stripe'"):
        plan_pieces(8, 2, "stripe")
    with pytest.raises(ValueError, match="the state would cross ranks at every token"):  # says why
        plan_pieces(8, 2, "stripe")
    q, k, v, a = inputs_for("decay", 8)
    with pytest.raises(ValueError, match="initial_state: expected none"):
        state_passing(decay_kernel, q, k, v, a, transition=Decay(decay_product), initial_state=q)
    with pytest.raises(ValueError, match="inputs: expected the same length at dim 1"):
        state_passing(decay_kernel, q, k[:, :4], v, a, transition=Decay(decay_product))
    with pytest.raises(ValueError, match="width: expected an integer >= 1"):
        causal_conv(depthwise(torch.ones(C, 1, dtype=torch.float64)), q, 0)
    # a shard that is not the rank's share of the documents' sequence is named with both lengths
    with pytest.raises(ValueError, match=r"inputs: expected 10 tokens at dim 1 \(rank 0's shard of 10 under .*got 8"):
        state_passing(decay_kernel, q, k, v, a, transition=Decay(decay_product), cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match=r"x: expected 10 tokens at dim 1 .*got 8"):
        causal_conv(depthwise(torch.ones(C, 1, dtype=torch.float64)), q, 2, cu_seqlens=[0, 4, 10])


def test_a_decay_is_exchanged_in_its_own_shape():
    """Decay's T travels per head (or per channel), not expanded to the state's shape; a T that does not
    broadcast to the state is refused, naming the decay."""
    q, k, v, a = inputs_for("decay", 6)
    t, s = Decay(decay_product).summarize(decay_kernel, [q, k, v, a], {})
    assert tuple(t.shape) == (B, H, DK, 1) and tuple(s.shape) == (B, H, DK, DV)
    per_head = Decay(lambda q, k, v, a: a.prod(dim=1).mean(-1)[..., None, None])
    assert tuple(per_head.summarize(decay_kernel, [q, k, v, a], {})[0].shape) == (B, H, 1, 1)
    with pytest.raises(ValueError, match=r"decay: expected T broadcastable to the state's shape \(2, 2, 3, 4\); got"):
        Decay(lambda q, k, v, a: a.prod(dim=1)).summarize(decay_kernel, [q, k, v, a], {})


def test_the_exchange_on_a_world_of_one_holds_the_rank_own_parts():
    """gather / scatter_sum (as the benchmark calls them, on any world): a world of one gets its parts back
    at [0], zero-padded to ``rows``, and its gradients back unsummed, with nothing sent."""
    from xcp.backends.cpu import CPUBackend
    from xcp.comm.protocol import SingleRank
    from xcp.recurrent.exchange import gather, scatter_sum

    class Counted(SingleRank):
        issued: list[str] = []

        def all_gather(self, send, recv, tag, backend, step=None):
            self.issued.append(tag)
            return super().all_gather(send, recv, tag, backend, step)

    parts = [torch.randn(2, 3, dtype=torch.float64) for _ in range(2)]
    got = gather(Counted(), CPUBackend(), None, parts, 3, "state")
    assert got.shape == (1, 3, 2, 3)
    assert torch.equal(got[0], torch.stack([*parts, torch.zeros(2, 3, dtype=torch.float64)]))
    grads = torch.randn(1, 3, 2, 3, dtype=torch.float64)
    assert torch.equal(scatter_sum(Counted(), CPUBackend(), None, grads, "dstate"), grads[0])
    assert Counted.issued == []  # no collective, no comm stream


def test_tie_with_nothing_to_tie_is_x_itself():
    """tie records an autograd node only where some other tensor needs a gradient and autograd records:
    else it returns ``x`` itself (no view, no node in an inference step's graph)."""
    from xcp.recurrent.exchange import tie

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    plain, needing = torch.randn(2, dtype=torch.float64), torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert tie(x) is x and tie(x, plain) is x
    with torch.no_grad():
        assert tie(x, needing) is x
    tied = tie(x, needing)
    assert tied is not x and torch.equal(tied, x)
    tied.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, dtype=torch.float64))
    assert torch.equal(needing.grad, torch.zeros(2, dtype=torch.float64))


def test_a_backward_outside_the_rank_thread_is_refused_rather_than_hanging():
    """A LocalWorld rank's exchange must run its backward in the rank's thread (the peers' all-to-all waits
    there); autograd run from another thread is told so at once, naming the exchange, for any P >= 2."""
    from xcp.backends.cpu import CPUBackend
    from xcp.recurrent.exchange import gather_differentiable

    def fn(group):
        x = torch.randn(2, dtype=torch.float64, requires_grad=True)
        return gather_differentiable(group, CPUBackend(), None, [x], 1, "state")

    out = xcp.LocalWorld(2, timeout=5).run(fn)[0]
    with pytest.raises(RuntimeError, match=r"backward of LocalWorld rank 0's state exchange outside its thread"):
        out.sum().backward()


def test_a_convolution_of_width_one_is_accepted_and_needs_no_halo(monkeypatch):
    """width=1, the smallest kernel: each output reads its own input alone, so every rank's result is its
    shard of the whole sequence's, with no collective issued (no halo to send)."""
    import xcp.recurrent.conv as conv_module

    exchanged = []
    real = conv_module.gather_differentiable
    monkeypatch.setattr(conv_module, "gather_differentiable", lambda *a: exchanged.append(a[-1]) or real(*a))
    x = torch.randn(B, 8, C, dtype=torch.float64)
    weight = torch.randn(C, 1, dtype=torch.float64)
    want, _ = whole(lambda xs: (depthwise(weight)(xs[0]), None), [x], [0, 8])

    def rank_fn(group):
        return causal_conv(depthwise(weight), xcp.shard(x, 2, group.rank()), 1, group=group)

    close("out", xcp.unshard(xcp.LocalWorld(2, timeout=30).run(rank_fn)), want)
    assert exchanged == []


def test_pieces_under_ulysses_follow_xcp_shard():
    """With ulysses U, rank r holds the (r % U)-th of U parts of ring shard r // U: each piece is the tokens
    xcp.shard(..., ulysses=U) gives it, and a part may span a zigzag shard's two chunks (two pieces)."""
    for world, ulysses, balance, seq in [(4, 2, "zigzag", 16), (6, 3, "zigzag", 24), (4, 2, "contiguous", 8)]:
        pieces = plan_pieces(seq, world, balance, ulysses=ulysses)
        ids = torch.arange(seq)[None]
        for r in range(world):
            held = torch.cat([ids[0, p.start : p.stop] for p in pieces if p.owner == r])
            assert torch.equal(held, xcp.shard(ids, world, r, balance=balance, ulysses=ulysses)[0]), (world, r)
    spanning = [(p.start, p.stop) for p in plan_pieces(24, 6, "zigzag", ulysses=3) if p.owner == 1]
    assert spanning == [(4, 6), (18, 20)]  # ring shard 0 is chunks [0, 6) and [18, 24): rank 1 its tokens 4..8
    with pytest.raises(ValueError, match="ulysses: expected a divisor of the world size 4"):
        plan_pieces(16, 4, "zigzag", ulysses=3)
    with pytest.raises(ValueError, match="seq_len: expected a multiple of the world size 4 with ulysses 2 .*got 10"):
        plan_pieces(10, 4, "contiguous", ulysses=2)


ULYSSES = [
    (4, 2, "zigzag", None),
    (4, 2, "contiguous", "docs"),
    (6, 3, "zigzag", "docs"),
    (4, 2, "document_zigzag", "docs"),
]


@pytest.mark.parametrize(
    ("world", "ulysses", "balance", "cu"), ULYSSES, ids=[f"P{w}-U{u}-{b}-{c}" for w, u, b, c in ULYSSES]
)
def test_state_passing_and_halos_under_ulysses(world, ulysses, balance, cu):
    """A gated delta rule after a causal convolution, the tokens placed as xcp.shard(..., ulysses=U) places
    them: outputs, the final state and every gradient equal the whole sequence's."""
    seq = 4 * world
    cu = documents(seq) if cu else [0, seq]
    q, k, v, g, beta = inputs_for("delta", seq)
    weight = torch.randn(H * DK, W, dtype=torch.float64)
    dout = torch.randn(B, seq, H, DV, dtype=torch.float64)
    ref = [x.clone().requires_grad_() for x in (q, k, v, g, beta, weight)]

    def conv(w):  # depthwise over the heads' channels of [B, L, H, DK]
        return lambda x: depthwise(w)(x.flatten(2)).view(x.shape)

    mixed, _ = whole(lambda xs: (conv(ref[5])(xs[0]), None), ref[:1], cu)
    out, final = whole(lambda xs: delta_kernel(*xs, output_final_state=True), [mixed, *ref[1:5]], cu)
    ((out * dout).sum() + final.sum()).backward()
    place = {"balance": balance, "ulysses": ulysses, "cu_seqlens": cu if balance == "document_zigzag" else None}
    docs = cu if len(cu) > 2 else None

    def rank_fn(group):
        r = group.rank()
        local = [xcp.shard(x, world, r, **place).requires_grad_() for x in (q, k, v, g, beta)]
        w = weight.clone().requires_grad_()
        opts = {"group": group, "balance": balance, "cu_seqlens": docs, "ulysses": ulysses}
        mixed = causal_conv(conv(w), local[0], W, **opts)
        o, f = state_passing(delta_kernel, mixed, *local[1:], transition=DeltaRule(), output_final_state=True, **opts)
        ((o * xcp.shard(dout, world, r, **place)).sum() + f.sum() * (r == 0)).backward()
        return o.detach(), f.detach(), [x.grad for x in local], w.grad

    results = xcp.LocalWorld(world, timeout=30).run(rank_fn)
    close("out", xcp.unshard([res[0] for res in results], **place), out.detach())
    for res in results:
        close("final state", res[1], final.detach())
    for i in range(5):
        close(f"grad of input {i}", xcp.unshard([res[2][i] for res in results], **place), ref[i].grad)
    close("grad of weight", sum(res[3] for res in results), ref[5].grad)


def test_a_delta_rule_with_its_values_at_another_position():
    """DeltaRule(value=1): a kernel taking (k, v, q, ...) has its keys first; the state's d_k comes from
    them, not from the values, and state passing stays exact (outputs and final state, 2 ranks; a world of
    one too). On a world of one, where nothing is exchanged, the arguments are still checked."""

    def kv_first(k, v, q, g, beta, **kwargs):
        return delta_kernel(q, k, v, g, beta, **kwargs)

    q, k, v, g, beta = inputs_for("delta", 8)
    want, want_final = whole(lambda xs: kv_first(*xs, output_final_state=True), [k, v, q, g, beta], [0, 8])

    def rank_fn(group):
        local = [xcp.shard(x, 2, group.rank()) for x in (k, v, q, g, beta)]
        return state_passing(kv_first, *local, transition=DeltaRule(value=1), group=group, output_final_state=True)

    results = xcp.LocalWorld(2, timeout=30).run(rank_fn)
    close("out", xcp.unshard([r[0] for r in results]), want)
    for r in results:
        close("final state", r[1], want_final)
    alone = state_passing(kv_first, k, v, q, g, beta, transition=DeltaRule(value=1))  # a world of one
    close("out of one rank", alone[0], want)
    assert alone[1] is None  # no final state unless asked
    with pytest.raises(ValueError, match="handoff: expected one of"):  # checked on a world of one too
        state_passing(kv_first, k, v, q, g, beta, transition=DeltaRule(value=1), handoff="later")
    from xcp.recurrent.state import prepare_passes

    assert prepare_passes(kv_first, k, v, q, g, beta, transition=DeltaRule(value=1)).output_final_state is False
    with pytest.raises(ValueError, match="inputs: expected at least one per-token tensor; got none"):
        state_passing(kv_first, transition=DeltaRule(value=1))
    own_start = DeltaRule(value=1)
    own_start.start = torch.zeros(B, H, DK, DV, dtype=torch.float64)  # sequences that start from a state of their own
    with pytest.raises(ValueError, match=r"cu_seqlens: expected None with a transition whose sequences start from"):
        state_passing(kv_first, k, v, q, g, beta, transition=own_start, cu_seqlens=[0, 3, 8])


def test_inference_outputs_need_no_gradient_on_a_rank_that_summarises_nothing():
    """Contiguous over 2 ranks without the final state: rank 1 holds only the last piece, whose summary is
    never used, and sends zeros instead. With inputs that need no gradient its outputs need none either
    (no graph kept for an exchange's backward that nothing will run), and they stay exact."""
    inputs = inputs_for("decay", 8)
    want, _ = whole(lambda xs: decay_kernel(*xs), inputs, [0, 8])

    def rank_fn(group):
        local = [xcp.shard(x, 2, group.rank(), balance="contiguous") for x in inputs]
        out, final = state_passing(decay_kernel, *local, transition=Decay(decay_product), group=group,
                                   balance="contiguous")  # fmt: skip
        return out, final

    results = xcp.LocalWorld(2, timeout=30).run(rank_fn)
    assert [(out.requires_grad, final) for out, final in results] == [(False, None), (False, None)]
    close("out", xcp.unshard([r[0] for r in results], balance="contiguous"), want)
