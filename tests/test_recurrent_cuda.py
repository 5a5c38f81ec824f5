"""Recurrent layers on a CUDA device: fla's kernels against the models' torch kernels, state passing with the
device's kernels against the whole sequence, and PyTorch's CUDA sanitizer (CSAN) on the hand-offs of state
passing and of the convolution halo (as tests/test_lifetime_cuda.py does for the ring).

Virtual ranks (LocalWorld threads, each on its own stream) cannot run a collective inside autograd's backward
on a GPU (one device thread for all ranks): the backward runs through ``xcp bench --recurrent``'s
:class:`~xcp.cli.bench.recurrent.VirtualStates`, whose exchange (and its gradients' all-to-all) runs outside
autograd with the same hand-offs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import xcp
from xcp.cli.bench.recurrent import Layer, VirtualStates
from xcp.kernels.recurrent import RecurrentKernel
from xcp.recurrent import DeltaRule, causal_conv, state_passing
from xcp.recurrent.kernels import recurrent_kernel, torch_kernel, transition
from xcp.testing.recurrent_sanitizer import delta_rule, short_conv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def recurrent_inputs(recurrence, seq, heads=2, dim=32, dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    if recurrence in ("gated_delta_rule", "kda"):
        gate = (1, seq, heads, dim) if recurrence == "kda" else (1, seq, heads)
        k = F.normalize(r(1, seq, heads, dim), dim=-1)
        xs = [r(1, seq, heads, dim), k, r(1, seq, heads, dim), F.logsigmoid(r(*gate) + 3), r(1, seq, heads).sigmoid()]
        return [x.to(dtype) if i in (0, 1, 2, 4) else x for i, x in enumerate(xs)], {}
    if recurrence == "simple_gla":
        xs = [
            r(1, seq, heads, dim),
            r(1, seq, heads, dim) * 0.1,
            r(1, seq, heads, dim),
            F.logsigmoid(r(1, seq, heads) + 3),
        ]
        return [x.to(dtype) if i < 3 else x for i, x in enumerate(xs)], {}
    dt = F.softplus(r(1, seq, heads) - 3)
    x, b, c = r(1, seq, heads, dim), r(1, seq, 1, dim), r(1, seq, 1, dim)
    return [x.to(dtype), dt, b.to(dtype), c.to(dtype)], {"A": -torch.rand(heads, generator=gen, device="cuda") - 0.5}


@pytest.mark.parametrize("recurrence", ["gated_delta_rule", "kda", "simple_gla", "mamba2"])
def test_the_device_kernel_matches_the_torch_kernel(recurrence):
    """fla's kernel (where installed: else the torch kernel against itself is skipped) against the models'
    torch kernel on the same float32 inputs: outputs, final states and every input's gradient, from a
    nonzero initial state (the state passing's pass 2 relies on it)."""
    kernel = recurrent_kernel(recurrence, "cuda")
    reference = torch_kernel(recurrence)
    if reference is None or kernel.label == reference.label:
        pytest.skip("needs fla (the device's kernel is the torch kernel itself)")
    inputs, kw = recurrent_inputs(recurrence, 200)
    h0 = torch.randn_like(reference.fn(*inputs, output_final_state=True, **kw)[1]) * 0.1
    results = []
    for fn in (kernel.fn, reference.fn):
        leaves = [x.clone().requires_grad_() for x in (*inputs, h0)]
        out, final = fn(*leaves[:-1], initial_state=leaves[-1], output_final_state=True, **kw)
        (out.float().sum() + final.float().square().sum()).backward()
        results.append((out.detach(), final.detach(), [x.grad for x in leaves]))
    (out, final, grads), (ref_out, ref_final, ref_grads) = results
    errors = {"out": rel(out, ref_out), "final state": rel(final, ref_final)}
    errors.update({f"grad of input {i}": rel(g, want) for i, (g, want) in enumerate(zip(grads, ref_grads))})
    # Triton's float32 dots run in TF32 (10-bit mantissa, ~5e-4 a product), summed over chunks of 64 and through
    # the delta rule's triangular solve (its WY form); the gradients through more such products. A wrong layout,
    # scale or transposed state is off by O(1), far above these bounds.
    bounds = {name: (2e-2 if name in ("out", "final state") else 5e-2) for name in errors}
    assert all(errors[n] < bounds[n] for n in errors), f"{kernel.label} against {reference.label}: {errors}"


@pytest.mark.parametrize("recurrence", ["gated_delta_rule", "mamba2"])
def test_state_passing_with_the_device_kernels(recurrence):
    """The device's kernel (fla's where installed), bf16, over 4 virtual ranks with the exchange outside
    autograd, forward and backward, against the same kernel on the whole sequence."""
    backend = xcp.get_backend("cuda")
    inputs, kw = recurrent_inputs(recurrence, 512, dtype=torch.bfloat16)
    layer = Layer(recurrence, recurrent_kernel(recurrence, "cuda"), transition(recurrence), inputs, kw)
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, _ = layer.kernel.fn(*leaves, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    ranks = VirtualStates(backend, layer, 4, dout)
    try:
        got = ranks.run(True)
    finally:
        ranks.close()
    assert rel(xcp.unshard([g[1] for g in got]), out.detach()) < 3e-2  # bf16 inputs and outputs
    for i, leaf in enumerate(leaves):
        assert rel(xcp.unshard([g[2][i] for g in got]), leaf.grad) < 5e-2, f"grad of input {i}"


def run_recurrent_world(world, handoff, seed=0):
    """On ``world`` virtual ranks of one GPU, each on its own caller stream, float64: a gated delta rule
    through state_passing and a short convolution through causal_conv (forward), and the delta rule's forward
    and backward through VirtualStates (the gradients' all-to-all). Returns the largest relative error against
    the same kernels on the whole sequence."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq, heads, dk, dv = 4 * world, 2, 3, 4
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float64)  # noqa: E731
    q, v = r(1, seq, heads, dk), r(1, seq, heads, dv)
    k = F.normalize(r(1, seq, heads, dk), dim=-1)
    g, beta = -r(1, seq, heads).abs() * 0.3, r(1, seq, heads).sigmoid()
    x, weight = r(1, seq, 5), r(5, 4)
    producer = torch.cuda.current_stream()

    def rank(group):
        stream = torch.cuda.Stream()
        stream.wait_stream(producer)
        with torch.cuda.stream(stream):
            local = [xcp.shard(t, world, group.rank()) for t in (q, k, v, g, beta)]
            out, final = state_passing(delta_rule, *local, transition=DeltaRule(), group=group, handoff=handoff,
                                       output_final_state=True)  # fmt: skip
            y = causal_conv(short_conv(weight), xcp.shard(x, world, group.rank()), 4, group=group, handoff=handoff)
            torch.cuda.current_stream().synchronize()
            return out, final, y

    results = xcp.LocalWorld(world, device="cuda").run(rank)
    want, want_final = delta_rule(q, k, v, g, beta, output_final_state=True)
    errors = [rel(xcp.unshard([res[0] for res in results]), want), rel(xcp.unshard([res[2] for res in results]),
              short_conv(weight)(x))] + [rel(res[1], want_final) for res in results]  # fmt: skip
    layer = Layer("delta", RecurrentKernel(delta_rule, "reference"), DeltaRule(), [q, k, v, g, beta])
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    ref, _ = delta_rule(*leaves)
    dout = r(*ref.shape)
    ref.backward(dout)
    ranks = VirtualStates(xcp.get_backend("cuda"), layer, world, dout)
    try:
        got = ranks.run(True)
    finally:
        ranks.close()
    errors += [rel(xcp.unshard([res[2][i] for res in got]), t.grad) for i, t in enumerate(leaves)]
    return max(errors)


def test_state_passing_and_halos_on_cuda_match_the_whole_sequence():
    assert run_recurrent_world(3, None) < 1e-10  # float64: only the order of the fold differs


CSAN_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.cuda._sanitizer as csan
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    import xcp, test_recurrent_cuda as t
    from xcp.lifetime import RingCall
    handoff, variant, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if variant == "mutant":  # the summaries' and halos' hand-off dropped: M reads them unordered with C's writes
        RingCall.hand_to_comm = lambda self, tensors, channel, ordered=False: list(tensors)
    csan.enable_cuda_sanitizer()
    run = xcp.LocalWorld.run
    def run_sanitized(self, fn, *args):  # CSAN's dispatch mode is per thread: enter it in every rank
        def body(g, *a):
            with csan.cuda_sanitizer.dispatch:
                return fn(g, *a)
        return run(self, body, *args)
    xcp.LocalWorld.run = run_sanitized
    print("clean recurrent", t.run_recurrent_world(world, handoff))
    """
)


def csan(handoff, variant, world=3):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = CSAN_SCRIPT.format(root=root, tests=os.path.join(root, "tests"))
    return subprocess.run([sys.executable, "-c", script, handoff, variant, str(world)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("handoff", ["record_stream", "clone"])
def test_pytorch_cuda_sanitizer_reports_nothing_in_state_passing_and_halos(handoff):
    done = csan(handoff, "correct")
    assert done.returncode == 0 and "clean recurrent" in done.stdout, done.stdout + done.stderr
    assert float(done.stdout.split("clean recurrent")[1].split()[0]) < 1e-10
    assert "CSAN detected a possible data race" not in done.stderr


def test_pytorch_cuda_sanitizer_sees_state_passing_without_its_hand_off():
    """With the hand-off of the packed summaries and halos dropped, CSAN reports the race, and the racing
    access is xcp's (the exchange's), not the test's."""
    done = csan("record_stream", "mutant")
    assert done.returncode != 0
    report = done.stderr
    assert "CSAN detected a possible data race" in report, done.stdout + report
    assert "/xcp/" in report.split("Previous access")[0]
    assert "aten::randn" not in report
