"""torch.compile(fullgraph=True) over xcp.attention: one opaque custom op (xcp/ops.py), no graph break,
the same numbers as eager, forward and backward. The torch.distributed path is compiled in
tests/test_gloo.py (2 processes, the default group, a new group and a DeviceMesh)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import xcp


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 64, 4, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 64, 2, 16, generator=gen).requires_grad_() for _ in range(2))
    sinks = torch.randn(4, generator=gen).requires_grad_()
    return q, k, v, sinks


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])

CALLS = {
    "causal": lambda q, k, v, s: xcp.attention(q, k, v, causal=True),
    "full, scale": lambda q, k, v, s: xcp.attention(q, k, v, scale=0.3),
    "documents, window, sinks": lambda q, k, v, s: xcp.attention(
        q, k, v, causal=True, sinks=s, window=(10, 0), cu_seqlens=[0, 5, 40, 64]
    ),
    "softcap, alibi, chunk": lambda q, k, v, s: xcp.attention(
        q, k, v, causal=True, softcap=2.0, alibi_slopes=SLOPES, chunk=24, cu_seqlens=[0, 5, 40, 64]
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_attention_is_one_graph_and_equals_eager(name, backend):
    torch._dynamo.reset()
    fn = CALLS[name]
    q, k, v, s = inputs()
    want = fn(q, k, v, s)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v, s), allow_unused=True)
    counter = CompileCounterWithBackend(backend)
    got = torch.compile(fn, fullgraph=True, backend=counter)(q, k, v, s)
    grads = torch.autograd.grad(got.sum(), (q, k, v, s), allow_unused=True)
    assert counter.frame_count == 1, "one graph, no break"
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    for g, w in zip(grads, want_grads):
        if w is None:
            assert g is None or not g.abs().any()
        else:
            torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6)


def test_the_compiled_graph_holds_the_ring_op():
    torch._dynamo.reset()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v, _ = inputs()
    torch.compile(lambda q, k, v: xcp.attention(q, k, v, causal=True), fullgraph=True, backend=keep)(q, k, v)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("xcp.ring_forward" in t for t in targets), targets


def test_a_local_world_group_is_refused_under_compile_with_the_reason():
    torch._dynamo.reset()
    q, k, v, _ = inputs()
    group = xcp.LocalWorld(1).group(0)
    fn = torch.compile(lambda q, k, v: xcp.attention(q, k, v, group=group), fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported, match="LocalWorld ranks are threads of one process"):
        fn(q, k, v)  # docs/integrations.md: xcp's ValueError, as dynamo's Unsupported under fullgraph=True
    torch._dynamo.reset()
    broken = torch.compile(lambda q, k, v: xcp.attention(q, k, v, group=group), backend="eager")
    assert torch.equal(broken(q, k, v), xcp.attention(q, k, v, group=group))  # without it: a graph break, eager


def test_documents_as_a_tensor_are_refused_under_compile():
    torch._dynamo.reset()
    q, k, v, _ = inputs()
    cu = torch.tensor([0, 5, 64])
    fn = torch.compile(lambda q, k, v: xcp.attention(q, k, v, cu_seqlens=cu), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="cu_seqlens: under torch.compile pass the boundaries as a list of ints"):
        fn(q, k, v)


def test_bad_documents_under_compile_are_named_by_the_op():
    torch._dynamo.reset()
    q, k, v, _ = inputs()
    fn = torch.compile(lambda q, k, v: xcp.attention(q, k, v, cu_seqlens=[0, 5, 63]), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"expected cu_seqlens\[-1\] == 64"):
        fn(q, k, v)


def test_the_ops_schema_is_made_from_the_call_spec():
    """The custom ops carry every field of xcp.spec.CallSpec, in its order, after the ALiBi slopes (a tensor,
    beside the spec), the group, the backend and the timeout: one list of options, kept in one place."""
    from xcp import ops  # noqa: F401  (registers the ops)
    from xcp.spec import spec_fields

    names = [f.name for f in spec_fields()]
    for op, tensors in ((torch.ops.xcp.ring_forward, 4), (torch.ops.xcp.ring_backward, 7)):  # 7th: dlse
        args = [a.name for a in op.default._schema.arguments]
        assert args[tensors:] == ["alibi_slopes", "group", "backend", "timeout", *names]
