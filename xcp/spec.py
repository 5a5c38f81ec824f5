"""The options of one attention call besides its tensors, group and backend, as one frozen value.

The ring (:class:`xcp.ring.RingConfig` is a spec with a group and a backend), the agreement check, the
hybrid and the compiled custom op all take this one spec, so a new option is added in one place. The
fields marked *agreed* must be equal on every rank of the group: ranks that differ in one would run rings
whose shards do not fit together (:mod:`xcp.agreement` checks them on first use); the others are each
rank's own choice (how it keeps its buffers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .schedule import DEFAULT_BALANCE

_AGREED = {"agreed": True}


@dataclass(frozen=True)
class CallSpec:
    """What one call computes, checked (by :mod:`xcp.checks`).

    :param causal: causal attention over the global sequence (agreed).
    :param scale: the factor on q·k (agreed).
    :param balance: how the sequence was sharded (agreed).
    :param slots: the slot policy, ``bounded`` (two receive slots) or ``keep_all``.
    :param handoff: the hand-off policy; None is the backend's own.
    :param documents: global document boundaries ``(0, ..., S)`` of a packed sequence, or None for one
        sequence (agreed).
    :param window: ``(left, right)`` sliding window over global positions; needs ``documents`` (``(0, S)``
        for one sequence) (agreed).
    :param ulysses: U, the ranks of a head group of the hybrid; 1 for the ring alone (agreed).
    :param softcap: logit soft-capping, ``softcap * tanh(s / softcap)`` on every score, or None (agreed).
    :param chunk: chunked attention: documents of ``chunk`` tokens aligned at global position 0, within the
        ``documents`` (their intersection); needs ``documents`` (``(0, S)`` for one sequence) (agreed).
    """

    causal: bool = field(metadata=_AGREED)
    scale: float = field(metadata=_AGREED)
    balance: str = field(default=DEFAULT_BALANCE, metadata=_AGREED)
    slots: str = "bounded"
    handoff: str | None = None
    documents: tuple[int, ...] | None = field(default=None, metadata=_AGREED)
    window: tuple[int | None, int | None] | None = field(default=None, metadata=_AGREED)
    ulysses: int = field(default=1, metadata=_AGREED)
    softcap: float | None = field(default=None, metadata=_AGREED)
    chunk: int | None = field(default=None, metadata=_AGREED)

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            if getattr(self, name) is not None and self.documents is None:
                raise ValueError(
                    f"{type(self).__name__}: a {name} needs documents, (0, S) for one sequence of S tokens"
                )


def spec_fields() -> tuple[dataclasses.Field, ...]:
    """The fields of :class:`CallSpec`, in order (what the compiled op's schema is made from)."""
    return dataclasses.fields(CallSpec)


def agreed_fields() -> tuple[str, ...]:
    """The names of the fields every rank must pass alike."""
    return tuple(f.name for f in spec_fields() if f.metadata.get("agreed"))


def spec_values(spec: CallSpec) -> dict[str, Any]:
    """The spec's fields by name (of a RingConfig too: its group and backend left out)."""
    return {f.name: getattr(spec, f.name) for f in spec_fields()}
