"""Every bad input to xcp.attention, xcp.shard and xcp.unshard fails up front with an error that names the
argument, what was expected and what came."""

from __future__ import annotations

import re

import pytest
import torch

import xcp


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


Q = (2, 8, 4, 6)  # [batch, seq, heads, head_dim]
KV = (2, 8, 2, 6)


def good():
    return t(*Q), t(*KV), t(*KV)


def raises(exc, *parts: str):
    """pytest.raises matching every part of the message literally, in order."""
    return pytest.raises(exc, match=".*".join(re.escape(p) for p in parts))


# ------------------------------------------------------------------------------------- xcp.attention


@pytest.mark.parametrize(
    ("q", "k", "v", "exc", "parts"),
    [
        ([0.0], t(*KV), t(*KV), TypeError, ["q: expected a torch.Tensor", "got list"]),
        (t(*Q), None, t(*KV), TypeError, ["k: expected a torch.Tensor", "got NoneType"]),
        (t(*Q), t(*KV), 3.0, TypeError, ["v: expected a torch.Tensor", "got float"]),
        (t(8, 4, 6), t(*KV), t(*KV), ValueError, ["q: expected 4 dims", "got 3 dims, shape (8, 4, 6)"]),
        (t(*Q), t(1, *KV), t(*KV), ValueError, ["k: expected 4 dims", "got 5 dims, shape (1, 2, 8, 2, 6)"]),
        (t(*Q, dtype=torch.int64), t(*KV), t(*KV), TypeError, ["q: expected a floating-point dtype", "torch.int64"]),
        (t(*Q), t(*KV, dtype=torch.float64), t(*KV), TypeError, ["k: expected dtype torch.float32", "torch.float64"]),
        (t(*Q), t(*KV), t(*KV, dtype=torch.bfloat16), TypeError, ["v: expected dtype torch.float32", "bfloat16"]),
        (t(*Q), t(*KV, device="meta"), t(*KV), ValueError, ["k: expected device cpu", "got meta"]),
        (t(*Q), t(*KV), t(2, 8, 1, 6), ValueError, ["v: expected shape (2, 8, 2, Dv)", "got (2, 8, 1, 6)"]),
        (t(*Q), t(3, 8, 2, 6), t(3, 8, 2, 6), ValueError, ["k: expected batch 2", "got 3"]),
        (t(*Q), t(2, 6, 2, 6), t(2, 6, 2, 6), ValueError, ["k: expected local sequence length 8", "got 6"]),
        (t(*Q), t(2, 8, 2, 5), t(2, 8, 2, 5), ValueError, ["k: expected head_dim 6", "got 5"]),
        (
            t(*Q),
            t(2, 8, 3, 6),
            t(2, 8, 3, 6),
            ValueError,
            ["k: expected a number of heads that divides the 4", "got 3"],
        ),
        (t(*Q), t(2, 8, 8, 6), t(2, 8, 8, 6), ValueError, ["divides the 4 heads of q", "got 8"]),
        (t(2, 0, 4, 6), t(2, 0, 2, 6), t(2, 0, 2, 6), ValueError, ["q: expected every dim", "got shape (2, 0, 4, 6)"]),
    ],
)
def test_attention_rejects_bad_tensors(q, k, v, exc, parts):
    with raises(exc, *parts):
        xcp.attention(q, k, v)


@pytest.mark.parametrize(
    ("kwargs", "exc", "parts"),
    [
        ({"causal": 1}, TypeError, ["causal: expected a bool", "got int"]),
        ({"causal": "yes"}, TypeError, ["causal: expected a bool", "got str"]),
        ({"balance": "ring"}, ValueError, ["balance: expected one of zigzag, contiguous, stripe", "got 'ring'"]),
        ({"scale": 0}, ValueError, ["scale: expected a positive finite number or None", "got 0"]),
        ({"scale": -0.5}, ValueError, ["scale: expected a positive", "got -0.5"]),
        ({"scale": float("nan")}, ValueError, ["scale: expected a positive finite", "got nan"]),
        ({"scale": float("inf")}, ValueError, ["scale: expected a positive finite", "got inf"]),
        ({"scale": "0.1"}, ValueError, ["scale: expected a positive finite", "got '0.1'"]),
        ({"scale": True}, ValueError, ["scale: expected a positive finite", "got True"]),
        ({"slots": "grow"}, ValueError, ["slots: expected one of bounded, keep_all", "got 'grow'"]),
        ({"handoff": "copy"}, ValueError, ["handoff: expected one of record_stream, clone, event, none", "'copy'"]),
        ({"group": 3}, TypeError, ["group: expected a torch.distributed ProcessGroup", "got int"]),
        ({"group": "world"}, TypeError, ["group: expected", "xcp.LocalWorld", "got str"]),
        ({"timeout": 0}, ValueError, ["timeout: expected a positive finite number of seconds or None", "got 0"]),
        ({"timeout": "5"}, ValueError, ["timeout: expected a positive finite", "got '5'"]),
        ({"timeout": float("inf")}, ValueError, ["timeout: expected a positive finite", "got inf"]),
        (
            {"timeout": 5, "group": xcp.LocalWorld(1).group(0)},
            ValueError,
            ["timeout: applies to torch.distributed groups", "LocalWorld(timeout=...)"],
        ),
    ],
)
def test_attention_rejects_bad_options(kwargs, exc, parts):
    with raises(exc, *parts):
        xcp.attention(*good(), **kwargs)


def test_unknown_device_lists_the_installed_backends():
    # xcp.plugins.get_backend reports a backend it cannot give as a RuntimeError (a lookup failure, not a
    # malformed value); the message names the argument and the value and lists what is installed.
    with pytest.raises(RuntimeError) as info:
        xcp.attention(*good(), device="tpu9")
    msg = str(info.value)
    assert msg.startswith("device='tpu9'") and "unknown" in msg
    assert "cpu: available" in msg


def test_a_backend_for_another_device_type_is_refused():
    q, k, v = (x.to("meta") for x in good())
    with raises(ValueError, "device: backend 'cpu' runs on cpu tensors", "q is on meta"):
        xcp.attention(q, k, v, device="cpu")


def test_odd_local_length_under_zigzag_causal():
    """Zigzag causal splits each rank's shard into two equal chunks: an odd local length cannot be split."""

    def rank_fn(group):
        q = t(1, 3, 2, 4, dtype=torch.float64)
        return xcp.attention(q, q, q, causal=True, group=group)

    # both ranks fail the same check; whichever fails first is the one reported
    with pytest.raises(
        RuntimeError,
        match=r"rank [01] of 2 failed: ValueError: q: balance 'zigzag' needs an even local "
        r"sequence length .*got 3",
    ):
        xcp.LocalWorld(2).run(rank_fn)
    # the same shapes are fine where no half block is needed
    for kwargs in ({"causal": False}, {"causal": True, "balance": "stripe"}, {"causal": True, "balance": "contiguous"}):

        def ok(group, kwargs=kwargs):
            q = t(1, 3, 2, 4, dtype=torch.float64)
            return xcp.attention(q, q, q, group=group, **kwargs).shape

        assert xcp.LocalWorld(2).run(ok) == [(1, 3, 2, 4)] * 2


def test_bad_input_raises_before_any_communication():
    """A rank with bad input fails at once; its peer is released instead of waiting for it."""

    def rank_fn(group):
        if group.rank() == 1:
            return xcp.attention(*good(), scale=-1.0, group=group)
        return xcp.attention(*good(), group=group)

    with raises(RuntimeError, "LocalWorld rank 1 of 2 failed: ValueError: scale: expected a positive") as info:
        xcp.LocalWorld(2, timeout=30).run(rank_fn)
    assert type(info.value.__cause__) is ValueError  # README: the rank's own error is the cause


def test_an_option_not_served_yet_is_a_not_implemented_error():
    """README: a bad argument is a TypeError or ValueError; an option xcp does not serve yet is this."""
    with pytest.raises(NotImplementedError, match=r"^ulysses: expected 1 .*; got ulysses=2"):
        xcp.KVCache(ulysses=2)


# ----------------------------------------------------------------------------------------- xcp.shard


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "parts"),
    [
        (([1.0, 2.0], 2, 0), {}, TypeError, ["x: expected a torch.Tensor", "got list"]),
        ((t(1, 8), 0, 0), {}, ValueError, ["world_size: expected an integer >= 1", "got 0"]),
        ((t(1, 8), -3, 0), {}, ValueError, ["world_size: expected an integer >= 1", "got -3"]),
        ((t(1, 8), 2.0, 0), {}, ValueError, ["world_size: expected an integer >= 1", "got 2.0"]),
        ((t(1, 8), 2, 2), {}, ValueError, ["rank: expected an integer in [0, 2)", "got 2"]),
        ((t(1, 8), 2, -1), {}, ValueError, ["rank: expected an integer in [0, 2)", "got -1"]),
        ((t(1, 8), 2, None), {}, ValueError, ["rank: expected an integer in [0, 2)", "got None"]),
        ((t(1, 8), 2, 0), {"dim": 2}, ValueError, ["dim: expected an integer in [-2, 2)", "got 2"]),
        ((t(1, 8), 2, 0), {"dim": -3}, ValueError, ["dim: expected an integer in [-2, 2)", "got -3"]),
        ((t(1, 8), 2, 0), {"dim": "1"}, ValueError, ["dim: expected an integer", "got '1'"]),
        ((t(1, 8), 2, 0), {"balance": "head-tail"}, ValueError, ["balance: expected one of", "got 'head-tail'"]),
        ((t(1, 6), 2, 0), {}, ValueError, ["x.shape[1]: balance 'zigzag' over 2 ranks", "multiple of 4; got 6"]),
        ((t(5, 8), 2, 0), {"dim": 0}, ValueError, ["x.shape[0]: balance 'zigzag'", "multiple of 4; got 5"]),
        ((t(1, 8), 3, 0), {"balance": "stripe"}, ValueError, ["balance 'stripe' over 3 ranks", "of 3; got 8"]),
    ],
)
def test_shard_rejects_bad_arguments(args, kwargs, exc, parts):
    with raises(exc, *parts):
        xcp.shard(*args, **kwargs)


# --------------------------------------------------------------------------------------- xcp.unshard


@pytest.mark.parametrize(
    ("shards", "kwargs", "exc", "parts"),
    [
        (t(2, 4), {}, TypeError, ["shards: expected a non-empty list of tensors", "got Tensor"]),
        ([], {}, TypeError, ["shards: expected a non-empty list of tensors", "got list"]),
        (None, {}, TypeError, ["shards: expected a non-empty list", "got NoneType"]),
        ([t(1, 4), "x"], {}, TypeError, ["shards[1]: expected a torch.Tensor", "got str"]),
        ([t(1, 4), t(1, 6)], {}, ValueError, ["shards[1]: expected shape (1, 4) (that of shards[0])", "got (1, 6)"]),
        ([t(1, 4)] * 2, {"balance": "ring"}, ValueError, ["balance: expected one of", "got 'ring'"]),
        ([t(1, 4)] * 2, {"dim": 5}, ValueError, ["dim: expected an integer in [-2, 2)", "got 5"]),
        ([t(1, 3)] * 2, {}, ValueError, ["2 shards of length 3 along dim 1", "multiple of 4; got 6"]),
    ],
)
def test_unshard_rejects_bad_arguments(shards, kwargs, exc, parts):
    with raises(exc, *parts):
        xcp.unshard(shards, **kwargs)


@pytest.mark.parametrize("world", [1, 2])
def test_double_backward_is_refused_not_silently_wrong(world):
    """xcp.attention is differentiable once (as flash kernels are): a second grad raises."""
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64) for _ in range(3))

    def rank_fn(group):
        ql, kl, vl = (xcp.shard(x, world, group.rank()).requires_grad_() for x in (q, k, v))
        out = xcp.attention(ql, kl, vl, causal=True, group=group)
        (dq,) = torch.autograd.grad(out.square().sum(), ql, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            dq.sum().backward()
        with pytest.raises(RuntimeError):  # never a silent, wrong second-order term
            torch.autograd.grad(dq.sum(), ql)
        return True

    assert xcp.LocalWorld(world).run(rank_fn) == [True] * world


@pytest.mark.parametrize(("world", "ulysses"), [(1, 1), (2, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("loss", ["sum", "grad_outputs"])
def test_a_second_grad_gets_the_same_clear_error_at_every_world_size(world, ulysses, loss):
    """``torch.autograd.grad(out, q, create_graph=True)`` then a grad of that gradient: the same "once
    differentiable" error in a world of one, over two ranks and through the hybrid's all-to-alls, whether the
    first grad's incoming gradient depends on out or not (never PyTorch's "not used in the graph")."""
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64) for _ in range(3))

    def rank_fn(group):
        ql, kl, vl = (xcp.shard(x, world, group.rank(), ulysses=ulysses).requires_grad_() for x in (q, k, v))
        out = xcp.attention(ql, kl, vl, causal=True, group=group, ulysses=ulysses)
        if loss == "sum":
            (dq,) = torch.autograd.grad(out.sum(), ql, create_graph=True)
        else:
            (dq,) = torch.autograd.grad(out, ql, torch.ones_like(out), create_graph=True)
        with pytest.raises(RuntimeError, match="xcp.attention: expected one backward .*once_differentiable"):
            torch.autograd.grad(dq.sum(), ql)
        return True

    assert xcp.LocalWorld(world).run(rank_fn) == [True] * world


def test_first_gradients_with_create_graph_equal_the_plain_ones():
    """create_graph=True changes nothing in the first gradients (only a second backward is refused)."""
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    plain = torch.autograd.grad(xcp.attention(q, k, v, causal=True).square().sum(), (q, k, v))
    graphed = torch.autograd.grad(xcp.attention(q, k, v, causal=True).square().sum(), (q, k, v), create_graph=True)
    assert all(torch.equal(a, b.detach()) and b.requires_grad for a, b in zip(plain, graphed))


def test_unshard_names_a_shard_of_another_dtype_or_device():
    a = torch.zeros(1, 4, 2, 3)
    expected = r"shards\[1\]: expected dtype torch.float32 \(that of shards\[0\]\); got torch.float64"
    with pytest.raises(TypeError, match=expected):
        xcp.unshard([a, a.double()])
    with pytest.raises(ValueError, match=r"shards\[1\]: expected device cpu \(that of shards\[0\]\); got meta"):
        xcp.unshard([a, a.to("meta")])


def test_numpy_scalars_are_accepted_like_python_ones():
    np = pytest.importorskip("numpy")
    q = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    want = xcp.attention(q, q, q, causal=True, scale=0.25)
    got = xcp.attention(q, q, q, causal=np.bool_(True), scale=np.float32(0.25))
    assert torch.equal(got, want)
    assert torch.equal(xcp.shard(q, np.int64(2), np.int64(1)), xcp.shard(q, 2, 1))
    assert torch.equal(xcp.shard(q, 2, 1, dim=np.int32(1)), xcp.shard(q, 2, 1))
    with pytest.raises(ValueError, match=r"rank: expected an integer in \[0, 2\); got np.int64\(2\) \(int64\)"):
        xcp.shard(q, 2, np.int64(2))
    with pytest.raises(TypeError, match=r"causal: expected a bool \(or numpy.bool_\); got int"):
        xcp.attention(q, q, q, causal=1)


@pytest.mark.parametrize(("raw", "want"), [("", None), ("  ", None), ("2.5", 2.5), ("30", 30.0)])
def test_the_timeout_environment_variable(monkeypatch, raw, want):
    from xcp.settings import TIMEOUT

    monkeypatch.setenv("XCP_TIMEOUT", raw)
    assert TIMEOUT.read() == want


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "nan", "inf"])
def test_a_bad_timeout_environment_variable_is_named(monkeypatch, raw):
    from xcp.settings import TIMEOUT

    monkeypatch.setenv("XCP_TIMEOUT", raw)
    with raises(ValueError, "XCP_TIMEOUT: expected a positive", repr(raw) if raw == "soon" else raw):
        TIMEOUT.read()


# ------------------------------------------------------------------------------- documents and sinks


def packed():
    return t(1, 8, 4, 6), t(1, 8, 2, 6), t(1, 8, 2, 6)


@pytest.mark.parametrize(
    ("kwargs", "exc", "parts"),
    [
        ({"cu_seqlens": torch.tensor([[0, 8]])}, ValueError, ["cu_seqlens: expected 1 dim", "got 2 dims"]),
        ({"cu_seqlens": torch.tensor([0.0, 8.0])}, TypeError, ["cu_seqlens: expected an integer dtype", "float32"]),
        ({"cu_seqlens": "0,8"}, TypeError, ["cu_seqlens: expected an integer tensor", "got str"]),
        ({"cu_seqlens": torch.tensor([1, 8])}, ValueError, ["cu_seqlens: expected cu_seqlens[0] == 0; got 1"]),
        ({"cu_seqlens": torch.tensor([0, 9])}, ValueError, ["expected cu_seqlens[-1] == 8", "got 9"]),
        (
            {"cu_seqlens": torch.tensor([0, 5, 4, 8])},
            ValueError,
            ["non-decreasing", "cu_seqlens[1] = 5 > cu_seqlens[2] = 4"],
        ),
        ({"sinks": [0.0] * 4}, TypeError, ["sinks: expected a float tensor [heads] or None", "got list"]),
        ({"sinks": torch.zeros(2)}, ValueError, ["sinks: expected shape (4,) (one logit per query head)", "(2,)"]),
        ({"sinks": torch.zeros(1, 4)}, ValueError, ["sinks: expected shape (4,)", "got (1, 4)"]),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, TypeError, ["sinks: expected a floating-point", "int64"]),
        ({"sinks": torch.zeros(4, device="meta")}, ValueError, ["sinks: expected device cpu", "got meta"]),
    ],
)
def test_bad_documents_and_sinks_are_named(kwargs, exc, parts):
    with raises(exc, *parts):
        xcp.attention(*packed(), **kwargs)


def test_documents_need_batch_one():
    with raises(ValueError, "q: expected batch 1 with cu_seqlens (the packed layout); got batch 2"):
        xcp.attention(*good(), cu_seqlens=torch.tensor([0, 8]))


def test_documents_and_sinks_are_not_mutated():
    cu, sinks = torch.tensor([0, 3, 8]), torch.zeros(4)
    before = cu.clone(), sinks.clone()
    xcp.attention(*packed(), cu_seqlens=cu, sinks=sinks, causal=True)
    assert torch.equal(cu, before[0]) and torch.equal(sinks, before[1])
