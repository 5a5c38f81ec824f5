"""The conformance suite on the built-in CPU backend, proof that it catches broken backends, and the
documented command line that runs it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import installed

import xcp
from xcp.backends.cpu import CPUBackend
from xcp.kernels.math import math_backward, math_forward
from xcp.testing import conformance
from xcp.testing.reference import allowed_pairs, reference_attention

CPU = CPUBackend()


@pytest.mark.parametrize("case", conformance.cases(CPU), ids=str)
def test_cpu_backend_conforms(case):
    case.run(xcp.get_backend("cpu"))


def test_cases_cover_every_claimed_dtype_mask_and_ring_layout():
    ids = {c.id for c in conformance.cases(CPU)}
    for dtype in ("float64", "float32", "bfloat16", "float16"):
        for mask in ("none", "causal", "strict"):
            assert {f"forward-{dtype}-{mask}-gqa", f"backward-{dtype}-{mask}-mha"} <= ids
        for p in (2, 3):
            assert {f"ring-{dtype}-P{p}-full-contiguous", f"ring-{dtype}-P{p}-causal-zigzag"} <= ids
    assert {"streams", "events", "handoff-clone", "handoff-record_stream", "memory-stats"} <= ids


def test_cases_follow_what_the_backend_claims():
    class Narrow(CPUBackend):
        name = "narrow"
        dtypes = (torch.float32,)
        masks = ("none", "causal")

    ids = [c.id for c in conformance.cases(Narrow())]
    assert not any("strict" in i or "float64" in i for i in ids)
    assert {"ring-float32-P3-causal-zigzag", "ring-float32-P3-causal-stripe"} <= set(ids)


def test_stripe_ring_runs_on_causal_calls_alone():
    """The ring runs stripe's strictly causal blocks as causal calls on shifted views: a backend that serves
    no strict mask (it raises if asked) passes the stripe ring check, and every call it got was causal or
    none, on square blocks where causal."""
    seen = []

    class NoStrict(CPUBackend):
        name = "no-strict"
        dtypes = (torch.float32,)
        masks = ("none", "causal")

        def forward(self, q, k, v, mask, scale):
            seen.append((mask, q.shape[1], k.shape[1]))
            if mask not in self.masks:
                raise AssertionError(f"asked for mask {mask}")
            return super().forward(q, k, v, mask, scale)

        def backward(self, dout, q, k, v, out, lse, mask, scale):
            seen.append((mask, q.shape[1], k.shape[1]))
            if mask not in self.masks:
                raise AssertionError(f"asked for mask {mask}")
            return super().backward(dout, q, k, v, out, lse, mask, scale)

    with installed(NoStrict()) as backend:
        conformance.check_ring(backend, torch.float32, 3, True, "stripe")
    assert seen and {m for m, _, _ in seen} == {"causal"}
    assert all(sq == sk for _, sq, sk in seen)
    n = conformance.RING_SEQ // 3
    assert {sq for _, sq, _ in seen} == {n, n - 1}  # the diagonal and src < r whole; src > r shifted by one


def test_reference_matches_torch_sdpa_in_float64():
    """The reference itself is checked against an independent implementation (masks with a key per row)."""
    q, k, v = (torch.randn(2, 7, 4, 8, dtype=torch.float64) for _ in range(3))
    for mask, is_causal in (("none", False), ("causal", True)):
        out, lse = reference_attention(q, k, v, mask, 0.3)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal, scale=0.3
        ).transpose(1, 2)
        torch.testing.assert_close(out, sdpa, rtol=1e-12, atol=1e-12)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
        scores = scores.masked_fill(~allowed_pairs(7, 7, mask), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    out, lse = reference_attention(q, k, v, "strict", 0.3)
    assert torch.isneginf(lse[:, :, 0]).all() and (out[:, 0] == 0).all()


# ------------------------------------------------------------------------------- the suite bites


class IgnoresScale(CPUBackend):
    def forward(self, q, k, v, mask, scale):
        return math_forward(q, k, v, mask, q.shape[-1] ** -0.5)


class WrongGroupMapping(CPUBackend):
    """Repeats KV heads as a tile (head h uses KV head h % Hkv) instead of per group (h // G)."""

    def forward(self, q, k, v, mask, scale):
        groups = q.shape[2] // k.shape[2]
        return math_forward(q, k.repeat(1, 1, groups, 1), v.repeat(1, 1, groups, 1), mask, scale)


class RecomputesLse(CPUBackend):
    """Normalises each block by its own log-sum-exp instead of the merged one it is given."""

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        own_out, own_lse = math_forward(q, k, v, mask, scale)
        return math_backward(dout, q, k, v, own_out.to(out.dtype), own_lse, mask, scale)


class NaiveSoftmax(CPUBackend):
    """Plain softmax: a row that sees no key becomes NaN."""

    def forward(self, q, k, v, mask, scale):
        out, lse = math_forward(q, k, v, mask, scale)
        blind = torch.isneginf(lse)
        return out.masked_fill(blind.transpose(1, 2).unsqueeze(-1), float("nan")), lse


class StrictAsCausal(CPUBackend):
    def forward(self, q, k, v, mask, scale):
        return math_forward(q, k, v, "causal" if mask == "strict" else mask, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        return math_backward(dout, q, k, v, out, lse, "causal" if mask == "strict" else mask, scale)


class HalfLse(CPUBackend):
    def forward(self, q, k, v, mask, scale):
        out, lse = math_forward(q, k, v, mask, scale)
        return out, lse.to(torch.bfloat16)


class Base2Lse(CPUBackend):
    """Keeps the log-sum-exp in base 2, as kernels that exponentiate with exp2 do internally."""

    def forward(self, q, k, v, mask, scale):
        out, lse = math_forward(q, k, v, mask, scale)
        return out, lse * math.log2(math.e)


class MutatesInput(CPUBackend):
    def forward(self, q, k, v, mask, scale):
        out, lse = math_forward(q, k, v, mask, scale)
        k.mul_(1.5)
        return out, lse


class PagedIgnoresLengths(CPUBackend):
    """Reads every key row up to max_k of each segment's table, whatever ``seqused_k`` says."""

    def forward_paged(self, q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q, max_k, scale, causal=False):
        full = torch.full_like(seqused_k, max_k)
        return super().forward_paged(q, k_pool, v_pool, block_table, cu_q, full, max_q, max_k, scale, causal)


F32 = {"dtype": torch.float32}


@pytest.mark.parametrize(
    ("broken", "check", "kwargs", "message"),
    [
        (IgnoresScale, conformance.check_forward, {**F32, "mask": "none", "heads": "mha"}, "forward out"),
        (WrongGroupMapping, conformance.check_forward, {**F32, "mask": "causal", "heads": "gqa"}, "forward out"),
        (RecomputesLse, conformance.check_split_keys, F32, "split-key backward"),
        (NaiveSoftmax, conformance.check_forward, {**F32, "mask": "strict", "heads": "mha"}, "NaN"),
        (StrictAsCausal, conformance.check_forward, {**F32, "mask": "strict", "heads": "mha"}, "forward"),
        (HalfLse, conformance.check_forward, {**F32, "mask": "none", "heads": "mha"}, "forward lse: expected dtype"),
        (Base2Lse, conformance.check_forward, {**F32, "mask": "causal", "heads": "gqa"}, "expected the natural-log"),
        (MutatesInput, conformance.check_forward, {**F32, "mask": "none", "heads": "mha"}, "modified in place"),
        (PagedIgnoresLengths, conformance.check_forward_paged, {**F32, "causal": False, "heads": "gqa"}, "paged"),
    ],
)
def test_suite_catches_a_broken_backend(broken, check, kwargs, message):
    backend = broken()
    with pytest.raises(AssertionError, match=message):
        check(backend, **kwargs)


def test_the_single_block_checks_pass_a_backend_that_only_breaks_the_ring():
    """RecomputesLse is right on a lone block; only the split-key and ring checks can catch it."""
    conformance.check_backward(RecomputesLse(), torch.float32, "causal", "gqa")
    with pytest.raises(AssertionError, match="dq"):
        conformance.check_ring(RecomputesLse(), torch.float32, 2, False, "contiguous")


def test_assert_close_reports_where_and_by_how_much():
    expected = torch.zeros(2, 3, dtype=torch.float64)
    actual = expected.clone()
    actual[1, 2] = 1e-3
    conformance.assert_close("x", actual, expected, torch.bfloat16)
    with pytest.raises(AssertionError, match=r"x: max abs error 0.001 at index \[1, 2\] exceeds 0.0001"):
        conformance.assert_close("x", actual, expected, torch.float32)


# ------------------------------------------------------------------------------- the documented command


def test_documented_command_runs_the_suite_from_any_directory(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "xcp.testing", "--xcp-backend", "cpu", "-q", "-k", "identity or ring-float32"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "7 passed" in done.stdout, done.stdout
    assert not any(tmp_path.iterdir()), "the suite wrote into the current directory"


def test_documented_command_loads_no_conftest_from_the_repository_root():
    """From xcp's own root, pytest would load tests/conftest.py (hypothesis, the tests' helpers): the
    documented command loads none, so a backend author needs pytest alone (docs/backends.md)."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "xcp.testing", "--xcp-backend", "cpu", "-q", "--co", "--trace-config"]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "conftest" not in done.stdout + done.stderr
    assert f"{len(conformance.cases(xcp.get_backend('cpu')))} tests collected" in done.stdout


def test_plugin_option_names_an_unusable_backend_and_lists_the_others():
    from xcp.testing.pytest_plugin import chosen_backend

    class Config:
        def __init__(self, name):
            self.name = name

        def getoption(self, dest, default=None):
            assert dest == "xcp_backend"
            return self.name

    assert chosen_backend(Config("cpu")).name == "cpu"
    with pytest.raises(pytest.UsageError) as err:
        chosen_backend(Config("no-such-device"))
    assert str(err.value).startswith("--xcp-backend=no-such-device: backend 'no-such-device' is unknown")
    assert "  cpu: available" in str(err.value)
    with pytest.raises(pytest.UsageError, match="python -m xcp.testing --xcp-backend NAME"):
        chosen_backend(Config(None))
