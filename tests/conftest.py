"""Shared test configuration: Hypothesis profiles, and the tests' float64 reference and ring runner
(tests/helpers.py) as fixtures.

Profiles: ``ci`` (no deadline, few examples, failing example printed as a reproducible blob) is chosen when
the ``CI`` environment variable is set, ``dev`` otherwise; ``HYPOTHESIS_PROFILE`` overrides both
(``thorough`` runs many more examples, for an occasional deep check).
"""

from __future__ import annotations

import os

import pytest
from helpers import independent_reference, ring_attention
from hypothesis import HealthCheck, settings

# Threads and a fresh autograd graph per example make timings noisy on a 2-core machine, so no profile
# has a deadline; example counts keep the whole suite within a few minutes there.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=20,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough", deadline=None, max_examples=500, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def reference():
    """:func:`helpers.independent_reference` (the tests' own float64 reference, not the library's) as a
    fixture."""
    return independent_reference


@pytest.fixture(scope="session")
def ring():
    """:func:`helpers.ring_attention` as a fixture."""
    return ring_attention
