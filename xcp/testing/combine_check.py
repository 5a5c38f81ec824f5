"""``check_combine``: the property suite an engine runs against its own combine of partial attentions.

A serving engine with decode context parallelism keeps its own cache and kernel, and merges the ranks'
partial attentions with its own collective. Its recent bugs sit exactly there: a rank holding nothing of a
row whose partial is NaN poisons the merge (0 x NaN), a base-2 lse merged as natural, rows no rank sees.
:func:`check_combine` draws such cases (Hypothesis) and runs the combine over a :class:`xcp.LocalWorld` of 1
to 8 virtual ranks, checking every rank's result against a float64 merge written here from the definition:
``L = logsumexp_r L_r``, ``O = sum_r exp(L_r - L) O_r`` over the ranks that saw the row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""Absolute and relative tolerance of the merged out per dtype: the result is rounded to out's dtype once
(a few units of its last place over values of about 1)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn case: the shapes, dtype, lse base, how often a rank sees nothing of a row, the lse's spread."""

    world: int
    lead: tuple[int, ...]
    seq: int
    heads: int
    value_dim: int
    dtype: torch.dtype
    lse_base: str
    empty: float
    spread: float
    seed: int

    def partials(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each rank's ``(out, lse as given, natural lse in float64)``: out NaN where the rank saw nothing."""
        g = torch.Generator().manual_seed(self.seed)
        lse_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        shape = (*self.lead, self.heads, self.seq)
        out = []
        for _ in range(self.world):
            o = torch.randn(*self.lead, self.seq, self.heads, self.value_dim, generator=g, dtype=torch.float64)
            natural = torch.randn(*shape, generator=g, dtype=torch.float64) * self.spread
            seen = torch.rand(*shape, generator=g, dtype=torch.float64) >= self.empty
            natural = torch.where(seen, natural, -math.inf)
            o = torch.where(seen.transpose(-1, -2).unsqueeze(-1), o, math.nan).to(self.dtype)
            given = (natural / math.log(2.0) if self.lse_base == "2" else natural).to(lse_dtype)
            out.append((o, given, given.double() * (math.log(2.0) if self.lse_base == "2" else 1.0)))
        return out


def reference(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 merge of the partials, from the definition (no xcp code): a rank's row weighs
    ``exp(L_r - L)`` where it saw the row and 0 where it did not; a row no rank saw is 0 with lse -inf."""
    lses = torch.stack([p[2] for p in parts])  # [P, ..., H, S]
    seen = lses > -math.inf
    top = torch.where(seen, lses, -math.inf).amax(0)
    anyone = seen.any(0)
    shift = torch.where(anyone, top, 0.0)
    sums = torch.where(seen, torch.exp(lses - shift), 0.0).sum(0)
    merged = torch.where(anyone, shift + torch.log(torch.where(anyone, sums, 1.0)), -math.inf)
    total = torch.zeros_like(parts[0][0], dtype=torch.float64)
    for (o, _, natural), sees in zip(parts, seen):
        w = torch.where(sees, torch.exp(natural - torch.where(anyone, merged, 0.0)), 0.0)
        total += torch.where(sees.transpose(-1, -2).unsqueeze(-1), o.double(), 0.0) * w.transpose(-1, -2).unsqueeze(-1)
    return total, merged


def check_case(combine: Callable[..., Any], case: Case) -> None:
    """Run ``combine`` over ``case.world`` virtual ranks and check every rank's result; AssertionError on a
    failure, naming the case."""
    from ..comm import LocalWorld

    parts = case.partials()
    want_out, want_lse = reference(parts)

    def rank(group: Any) -> tuple[Any, bool]:
        o, lse, _ = parts[group.rank()]
        kept = (o.clone(), lse.clone())
        got = combine(o, lse, group, lse_base=case.lse_base)
        untouched = all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip((o, lse), kept))
        return got, untouched

    try:
        with LocalWorld(case.world) as world:
            results = world.run(rank)
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"check_combine: the combine raised {e!r} on {case}") from e
    tol = TOLERANCES[case.dtype]
    lse_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    first = None
    for r, (got, untouched) in enumerate(results):
        where = f"rank {r} of {case}"
        if not untouched:
            raise AssertionError(f"check_combine: the combine changed its inputs on {where}")
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"check_combine: expected (out, lse); got {type(got).__name__} on {where}")
        out, lse = got
        _expect(out.dtype == case.dtype and out.shape == want_out.shape, f"out {out.dtype} {tuple(out.shape)}", where,
                f"{case.dtype} {tuple(want_out.shape)}")  # fmt: skip
        _expect(lse.dtype == lse_dtype and lse.shape == want_lse.shape, f"lse {lse.dtype} {tuple(lse.shape)}", where,
                f"{lse_dtype} {tuple(want_lse.shape)}")  # fmt: skip
        _expect(not out.isnan().any() and not lse.isnan().any(), "NaN in out or lse", where, "no NaN")
        nobody = want_lse == -math.inf
        _expect(bool((lse[nobody] == -math.inf).all()), "a finite lse on a row no rank saw", where, "-inf")
        _expect(bool((out.transpose(-3, -2)[nobody] == 0).all()), "a nonzero out on a row no rank saw", where, "0")
        seen = ~nobody
        lse_err = (lse.double()[seen] - want_lse[seen]).abs()
        lse_ok = bool((lse_err <= 1e-5 * (1 + want_lse[seen].abs())).all())
        worst = lse_err.max().item() if seen.any() else 0.0
        _expect(lse_ok, f"lse off by {worst:.3g}", where, "the natural-log logsumexp of the ranks' lse")
        err = (out.double() - want_out).abs()
        bound = tol * (1 + want_out.abs())
        _expect(bool((err <= bound).all()), f"out off by {err.max().item():.3g}", where, f"within {tol:g} of the merge")
        if first is None:
            first = (out, lse)
        else:
            same = torch.equal(out, first[0]) and torch.equal(lse, first[1])
            _expect(same, "a result that differs from rank 0's", where, "the same result on every rank")


def _expect(ok: bool, got: str, where: str, want: str) -> None:
    if not ok:
        raise AssertionError(f"check_combine: expected {want}; got {got} on {where}")


def cases(world_sizes: tuple[int, ...] = tuple(range(1, 9))) -> Any:
    """The Hypothesis strategy of :class:`Case` s."""
    from hypothesis import strategies as st

    return st.builds(
        Case,
        world=st.sampled_from(world_sizes),
        lead=st.lists(st.integers(1, 3), max_size=2).map(tuple),
        seq=st.integers(1, 5),
        heads=st.integers(1, 3),
        value_dim=st.sampled_from((1, 2, 8)),
        dtype=st.sampled_from(DTYPES),
        lse_base=st.sampled_from(("e", "2")),
        empty=st.sampled_from((0.0, 0.5, 0.9, 1.0)),
        spread=st.sampled_from((1.0, 30.0)),
        seed=st.integers(0, 2**31 - 1),
    )


def check_combine(
    combine: Callable[..., Any],
    *,
    max_examples: int = 40,
    world_sizes: tuple[int, ...] = tuple(range(1, 9)),
    shrink: bool = True,
) -> None:
    """Check ``combine`` (with :func:`xcp.combine`'s signature: ``combine(out, lse, group, *, lse_base)`` ->
    ``(out, lse)``) on ``max_examples`` drawn cases over 1 to 8 virtual ranks: ranks that saw nothing of a
    row with NaN partials, lse in base e and 2, rows no rank saw, any leading dims, 16-bit partials. Every
    rank's out must match the float64 merge in out's dtype, its lse the natural-log one in float32 (float64
    for float64), NaN nowhere, rows no rank saw 0 with lse -inf, the same on every rank, the inputs left as
    they were. Raises AssertionError naming the failing case (shrunk to a smallest one unless ``shrink`` is
    False, which reports the first found sooner); returns None when all pass."""
    from hypothesis import HealthCheck, Phase, given, settings

    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p != Phase.shrink)

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=phases)  # fmt: skip
    @given(case=cases(world_sizes))
    def suite(case: Case) -> None:
        check_case(combine, case)

    suite()


__all__ = ["Case", "cases", "check_case", "check_combine", "reference"]
