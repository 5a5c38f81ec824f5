"""The recurrent kernels by name (xcp.recurrent.recurrent_kernel): each recurrence's kernel on the CPU (the
models' torch kernels, xcp's simple GLA) through state passing over LocalWorld(P), float32, against the same
kernel on the whole sequence (outputs and every input's gradient); a backend's own kernel picked first and
shown by ``xcp backends``; unknown names refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import xcp
from xcp.backends.cpu import CPUBackend
from xcp.cli import main
from xcp.kernels.recurrent import RECURRENCES, RecurrentKernel
from xcp.recurrent import state_passing
from xcp.recurrent.kernels import recurrent_kernel, torch_simple_gla, transition

pytest.importorskip("transformers", reason="needs transformers")
B, H, D = 1, 2, 8


def inputs_of(recurrence: str, seq: int) -> tuple[list[torch.Tensor], dict]:
    gen = torch.Generator().manual_seed(seq)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if recurrence in ("gated_delta_rule", "kda"):
        gate = (B, seq, H, D) if recurrence == "kda" else (B, seq, H)
        k = F.normalize(r(B, seq, H, D), dim=-1)
        return [r(B, seq, H, D), k, r(B, seq, H, D), -r(*gate).abs() * 0.2, r(B, seq, H).sigmoid()], {}
    if recurrence == "simple_gla":
        return [r(B, seq, H, D), r(B, seq, H, D), r(B, seq, H, D), -r(B, seq, H).abs() * 0.2], {}
    dt = F.softplus(r(B, seq, H)) * 0.2
    return [r(B, seq, H, D), dt, r(B, seq, 1, D), r(B, seq, 1, D)], {"A": -torch.rand(H, generator=gen) - 0.5}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("recurrence", list(RECURRENCES))
def test_each_recurrence_passes_state_exactly_on_the_cpu(recurrence):
    world, seq = 3, 48
    kernel = recurrent_kernel(recurrence, "cpu").fn
    inputs, kw = inputs_of(recurrence, seq)
    leaves = [x.clone().requires_grad_() for x in inputs]
    expected, _ = kernel(*leaves, **kw)
    dout = torch.randn_like(expected)
    expected.backward(dout)

    def rank(group):
        r = group.rank()
        local = [xcp.shard(x, world, r).requires_grad_() for x in inputs]
        out, _ = state_passing(kernel, *local, transition=transition(recurrence), group=group, **kw)
        out.backward(xcp.shard(dout, world, r))
        return out.detach(), [x.grad for x in local]

    got = xcp.LocalWorld(world, timeout=60).run(rank)
    assert rel(xcp.unshard([g[0] for g in got]), expected.detach()) < 2e-5  # float32 kernels, another order
    for i, leaf in enumerate(leaves):
        assert rel(xcp.unshard([g[1][i] for g in got]), leaf.grad) < 2e-4, f"grad of input {i}"


def test_a_backends_own_kernel_is_picked_and_listed(capsys):
    served = RecurrentKernel(torch_simple_gla, "vendor gla (test)")
    own = type("Own", (CPUBackend,), {"name": "own", "recurrent_kernels": lambda self: {"simple_gla": served}})

    class Plugin:
        @xcp.hookimpl
        def xcp_register_backends(self, register):
            register(own())

    plugin = Plugin()
    xcp.register_plugin(plugin, name="own-plugin")
    try:
        assert recurrent_kernel("simple_gla", "own") is served
        assert recurrent_kernel("simple_gla", "cpu").label == "xcp torch_simple_gla (torch)"
        assert "transformers torch_chunk_gated_delta_rule" in recurrent_kernel("gated_delta_rule", "own").label
        assert main(["backends"]) == 0
        out = capsys.readouterr().out
        assert "own recurrent simple_gla: vendor gla (test)" in out
        assert "cpu recurrent mamba2: transformers mamba2_chunk_scan (torch)" in out
    finally:
        xcp.unregister_plugin(plugin)


def test_an_unknown_recurrence_is_refused():
    with pytest.raises(ValueError, match="recurrence: expected one of gated_delta_rule, kda, simple_gla, mamba2; got"):
        recurrent_kernel("gla")


def test_fla_named_kernels_in_a_modeling_module_are_served():
    """A mixer module holding fla's ``chunk_gated_delta_rule`` (fla's positional order: scale, initial_state,
    output_final_state after beta) is served by the dispatchers: under a context, state passing over the
    ranks; exact against the kernel on the whole sequence, final state included (float64 reference kernel)."""
    from xcp.integrations import transformers_recurrent as tr
    from xcp.testing.recurrent_sanitizer import delta_rule

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        assert scale == 0.5 and not kw, (scale, kw)  # what the caller passed, positionally, reaches the kernel
        return delta_rule(q * scale, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state)

    assert "chunk_gated_delta_rule" in tr.KERNELS and "chunk_kda" in tr.KERNELS
    dispatch = tr._dispatcher(chunk_gated_delta_rule, tr.KERNELS["chunk_gated_delta_rule"])
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, v, k = r(1, 12, 2, 3), r(1, 12, 2, 4), F.normalize(r(1, 12, 2, 3), dim=-1)
    g, beta = -r(1, 12, 2).abs() * 0.3, r(1, 12, 2).sigmoid()
    want, want_final = chunk_gated_delta_rule(q, k, v, g, beta, 0.5, None, True)

    def rank(group):
        local = [xcp.shard(t, 2, group.rank()) for t in (q, k, v, g, beta)]
        with tr._running(tr._Run(group, "zigzag", "FlaMixer")):
            return dispatch(*local, 0.5, None, True)

    got = xcp.LocalWorld(2).run(rank)
    assert rel(xcp.unshard([o for o, _ in got]), want) < 1e-12
    assert all(rel(final, want_final) < 1e-12 for _, final in got)
