"""Hybrid layers on Ascend: xcp.recurrent's state passing and halo exchange on NPUBackend (its hand-off policy,
``clone``) with the models' own torch kernels (no vendor kernel: docs/hybrid.md), on the lifetime sanitizer's
simulated streams (tests/npu_standin.py's ``NPUOnSim``; the tensors stay on the CPU).

References: the same kernel on the whole sequence on one device (the models' kernels compute in float32 whatever
the inputs: errors relative to the largest value within 2e-5, gradients 2e-4, as tests/test_recurrent_kernels.py
allows on the CPU backend; a state dropped or passed twice is off by O(1)), and for the sanitizer run its float64
reference kernels (1e-12).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import installed
from npu_standin import FakeTorchNPU, NPUOnSim

import xcp
from xcp import lifetime
from xcp.kernels.recurrent import RECURRENCES
from xcp.recurrent import state_passing
from xcp.recurrent.kernels import recurrent_kernel, transition
from xcp.testing.recurrent_sanitizer import sanitize_recurrent
from xcp.testing.sanitizer import Sanitizer, gathered_findings, peers_rows


@pytest.fixture
def policies(monkeypatch):
    """The hand-off policies xcp applies, in order (the stand-in torch_npu installed: NPUBackend imports it)."""
    monkeypatch.setitem(sys.modules, "torch_npu", FakeTorchNPU())
    seen: list[str] = []
    real = lifetime.hand_off
    monkeypatch.setattr(lifetime, "hand_off", lambda b, t, c, p: seen.append(p) or real(b, t, c, p))
    return seen


@pytest.mark.parametrize("options", [{}, {"balance": "document_zigzag", "seq": 9, "documents": [0, 1, 5, 9]}])
def test_state_passing_and_halos_on_npu_streams_hand_off_by_clone(policies, options):
    """A delta-rule layer's state passing and a short convolution's halos, forward and backward, over virtual ranks
    on NPUBackend's streams: every summary and halo goes to the comm stream by ``clone`` (the backend's policy, no
    ``handoff`` given), the sanitizer finds nothing, and outputs and gradients equal the whole sequence's."""
    report = sanitize_recurrent(world=3 if not options else 2, backend=NPUOnSim, **options)
    assert report.ok, report.format()
    assert report.config["handoff"] == "clone" and policies and set(policies) == {"clone"}
    assert max(report.max_error.values()) <= 1e-12


def test_a_dropped_hand_off_on_npu_streams_is_a_race(policies, monkeypatch):
    monkeypatch.setattr(lifetime.RingCall, "hand_to_comm", lambda self, tensors, channel, ordered=False: tensors)
    report = sanitize_recurrent(world=3, backend=NPUOnSim)
    assert "race" in report.kinds(), report.format()
    assert "xcp/recurrent/exchange.py" in report.format()


def _inputs(recurrence: str, seq: int) -> tuple[list[torch.Tensor], dict]:
    """float64 inputs of ``recurrence``'s convention (xcp.kernels.recurrent), 2 heads of 8."""
    gen = torch.Generator().manual_seed(seq)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if recurrence in ("gated_delta_rule", "kda"):
        gate = (1, seq, 2, 8) if recurrence == "kda" else (1, seq, 2)
        return [r(1, seq, 2, 8), F.normalize(r(1, seq, 2, 8), dim=-1), r(1, seq, 2, 8), -r(*gate).abs() * 0.2,
                r(1, seq, 2).sigmoid()], {}  # fmt: skip
    if recurrence == "simple_gla":
        return [r(1, seq, 2, 8), r(1, seq, 2, 8), r(1, seq, 2, 8), -r(1, seq, 2).abs() * 0.2], {}
    dt = F.softplus(r(1, seq, 2)) * 0.2
    return [r(1, seq, 2, 8), dt, r(1, seq, 1, 8), r(1, seq, 1, 8)], {"A": -torch.rand(2, generator=gen).double() - 0.5}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("recurrence", list(RECURRENCES))
def test_the_models_torch_kernels_pass_state_on_the_npu_backend(policies, recurrence):
    """Each recurrence on the NPU backend runs the models' own torch kernel (NPUBackend serves none of its own), its
    state passed over 3 virtual ranks on NPUBackend's streams with ``clone`` hand-offs: out and every input's gradient
    equal the kernel on the whole sequence on one device, and the sanitizer finds nothing."""
    pytest.importorskip("transformers", reason="needs transformers")
    world, seq = 3, 24
    inputs, kw = _inputs(recurrence, seq)
    leaves = [x.clone().requires_grad_() for x in inputs]
    with Sanitizer() as san, installed(NPUOnSim(san.model)):
        kernel = recurrent_kernel(recurrence, "npu-sim")
        assert kernel.label.endswith("(torch)"), kernel.label
        expected, _ = kernel.fn(*leaves, **kw)
        dout = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        expected.backward(dout)

        def rank(group):
            with san.thread(f"rank{group.rank()}"), lifetime.track_buffers() as ledger:
                local = [xcp.shard(x, world, group.rank()).requires_grad_() for x in inputs]
                out, _ = state_passing(kernel.fn, *local, transition=transition(recurrence), group=group,
                                       device="npu-sim", **kw)  # fmt: skip
                out.backward(xcp.shard(dout, world, group.rank()))
                return ledger, out.detach(), [x.grad for x in local]

        world_ = xcp.LocalWorld(world, timeout=60)
        got = world_.run(rank)
        ledgers = [g[0] for g in got]
        assert _rel(xcp.unshard([g[1] for g in got]), expected.detach()) < 2e-5
        for i, leaf in enumerate(leaves):
            assert _rel(xcp.unshard([g[2][i] for g in got]), leaf.grad) < 2e-4, f"grad of input {i}"
        del got
        world_.release_buffers()
        del world_
        findings, _ = gathered_findings(san, ledgers)
    # a virtual rank reading its peers' rows of the exchange (shared memory of one process) is set aside, as
    # sanitize_recurrent does: not a race of one rank's streams
    bad = [f for f in findings if not peers_rows(f, ("state", "dstate"))]
    assert bad == [], [(f.kind, f.message, [a.op for a in f.accesses]) for f in bad][:3]
    assert set(policies) == {"clone"}
