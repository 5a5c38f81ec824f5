"""The third-party example backend (examples/xcp-tiled-backend), installed as its own package and found
through the ``xcp`` entry point, passes the conformance suite and serves ``xcp.attention(device="tiled")``.

It must be installed: ``pip install --no-deps -e examples/xcp-tiled-backend`` (CI does).
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import torch
from helpers import independent_reference

import xcp
from xcp.testing import conformance

INSTALL = "pip install --no-deps -e examples/xcp-tiled-backend"


def tiled_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group="xcp") if ep.name == "tiled"]
    assert eps, f"the example backend is not installed; run: {INSTALL}"
    return eps[0]


def test_found_through_its_entry_point_as_a_separate_distribution():
    ep = tiled_entry_point()
    assert ep.value == "xcp_tiled.plugin"
    assert ep.dist.metadata["Name"] == "xcp-tiled-backend"
    row = next(r for r in xcp.backend_table() if r.name == "tiled")
    assert (row.device_type, row.plugin, row.available) == ("cpu", "tiled", True)
    assert type(xcp.get_backend("tiled")).__module__ == "xcp_tiled.backend"


def test_docs_backends_md_gives_the_suites_true_case_counts():
    """docs/backends.md says how many cases run on tiled and on cpu: the numbers conformance.cases gives."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "backends.md").read_text()
    m = re.search(r"(\d+) on the example backend `tiled` and (\d+) on the built-in `cpu`", " ".join(doc.split()))
    assert m, "docs/backends.md: the sentence with the case counts is gone"
    counts = {name: len(conformance.cases(xcp.get_backend(name))) for name in ("tiled", "cpu")}
    assert (int(m.group(1)), int(m.group(2))) == (counts["tiled"], counts["cpu"]), counts


def _cases():
    tiled_entry_point()
    return conformance.cases(xcp.get_backend("tiled"))


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_tiled_backend_conforms(case):
    case.run(xcp.get_backend("tiled"))


@pytest.mark.parametrize("tile", [1, 5, 64])
@pytest.mark.parametrize("mask", ["none", "causal", "strict"])
def test_any_tile_size_gives_the_same_attention(tile, mask):
    """Tiles of one key, tiles that do not divide the sequence, and one tile wider than it."""
    from xcp_tiled import TiledBackend

    backend = TiledBackend(tile=tile)
    conformance.check_forward(backend, torch.float32, mask, "gqa")
    conformance.check_backward(backend, torch.float32, mask, "gqa")


def test_attention_with_device_tiled_uses_the_tiled_kernel(monkeypatch):
    import xcp_tiled.backend

    calls = []
    real = xcp_tiled.backend.tiled_forward
    monkeypatch.setattr(xcp_tiled.backend, "tiled_forward", lambda *a: calls.append(a[3]) or real(*a))
    q, k, v = (torch.randn(1, 8, 4, 16, dtype=torch.float64) for _ in range(3))
    world = xcp.LocalWorld(2)

    def rank(group):
        parts = [xcp.shard(x, 2, group.rank()) for x in (q, k, v)]
        return xcp.attention(*parts, causal=True, group=group, device="tiled")

    got = xcp.unshard(world.run(rank))
    assert "causal" in calls and "none" in calls
    expected = independent_reference(q, k, v, torch.zeros_like(q), True).out  # the output alone is compared
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)  # float64 throughout
