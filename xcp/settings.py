"""Every ``XCP_*`` environment variable, declared once, read by one parser.

A :class:`Setting` names a variable, its kind (a flag, seconds, a choice or a name), its default, what it
means and when it is read. The core declares its own here (:data:`CORE`); a backend declares its own in its
package and lists them in its ``settings`` attribute (a tool hook of the contract), so the core never names
a vendor and ``xcp backends --settings`` can print every setting of every installed backend with its
current value. Code reads a variable only through :meth:`Setting.read`; nothing else in the repository
calls ``os.environ`` for an ``XCP_*`` name (a test checks it, and that the docs list exactly the declared
variables).

Values are read when the setting says (``READ_*``), never cached here: a test or a user that changes the
environment sees the new value at the next such moment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

KINDS = ("flag", "seconds", "choice", "name")
"""flag: ``0`` or ``1``; seconds: a positive finite number; choice: one of :attr:`Setting.choices`;
name: any non-empty word (e.g. a backend name)."""

READ_PER_CALL = "at each call that needs it"
READ_AT_CONSTRUCTION = "when the backend object is built (the registered one: at plugin discovery)"
READ_AT_DISCOVERY = "when the plugins are first discovered (xcp.plugins.reload_plugins() reads it again)"


@dataclass(frozen=True)
class Setting:
    """One environment variable: what it holds, its default (None: unset means "not given"), its meaning
    and when it is read."""

    name: str
    kind: str
    default: Any
    meaning: str
    read_when: str
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith("XCP_"):
            raise ValueError(f"Setting.name: expected a name starting with XCP_; got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Setting.kind: expected one of {', '.join(KINDS)}; got {self.kind!r}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"Setting.choices: expected choices exactly for kind 'choice'; got {self.choices!r}")

    def raw(self) -> str | None:
        """The variable's text, stripped; None when it is unset or empty."""
        value = os.environ.get(self.name, "").strip()
        return value or None

    def read(self, default: Any = None) -> Any:
        """The variable's value, parsed by its kind; ``default`` (else the declared default) when unset.

        :raises ValueError: ``NAME: expected ...; got '...'`` for a value the kind does not take.
        """
        text = self.raw()
        if text is None:
            return self.default if default is None else default
        return self.parse(text)

    def parse(self, text: str) -> Any:
        """``text`` as this setting's kind (see :data:`KINDS`)."""
        if self.kind == "flag":
            if text not in ("0", "1"):
                raise ValueError(f"{self.name}: expected 0 or 1; got {text!r}")
            return text == "1"
        if self.kind == "seconds":
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{self.name}: expected a positive number of seconds; got {text!r}")
            return value
        if self.kind == "choice":
            if text not in self.choices:
                raise ValueError(f"{self.name}: expected one of {', '.join(self.choices)}; got {text!r}")
            return text
        return text


TIMEOUT = Setting(
    "XCP_TIMEOUT",
    "seconds",
    None,
    "bound on a wait for a peer of a torch.distributed group, when attention(timeout=) is not given "
    "(unset: 600 s for waits that block the host, e.g. gloo, but never more than the group's own timeout; "
    "device waits, NCCL and HCCL, are then left to the process group)",
    READ_PER_CALL,
)
DEVICE = Setting(
    "XCP_DEVICE",
    "name",
    None,
    "the backend when neither device= nor the tensors' device type chooses one (unset: cpu)",
    READ_PER_CALL,
)
DISABLE_PLUGIN_AUTOLOAD = Setting(
    "XCP_DISABLE_PLUGIN_AUTOLOAD",
    "flag",
    False,
    "1 skips the entry points of the group 'xcp': only the built-in cpu backend and plugins registered "
    "in code are known",
    READ_AT_DISCOVERY,
)

CORE: tuple[Setting, ...] = (TIMEOUT, DEVICE, DISABLE_PLUGIN_AUTOLOAD)
"""The settings of the device-agnostic core."""


def declared(backends: Iterable[Any] = ()) -> tuple[Setting, ...]:
    """The core's settings, then those each of ``backends`` lists in its ``settings`` attribute (each name
    once; a name declared twice with different contents is a ValueError naming both owners)."""
    seen: dict[str, tuple[Setting, str]] = {s.name: (s, "xcp") for s in CORE}
    for backend in backends:
        owner = getattr(backend, "name", type(backend).__name__)
        for s in getattr(backend, "settings", ()):
            if s.name in seen and seen[s.name][0] != s:
                raise ValueError(f"{s.name}: declared by {seen[s.name][1]!r} and differently by {owner!r}")
            seen.setdefault(s.name, (s, owner))
    return tuple(s for s, _ in seen.values())


def describe(setting: Setting) -> dict[str, str]:
    """A row for ``xcp backends --settings``: name, kind, default, current value (or the parse error),
    meaning, when read."""
    kind = setting.kind if setting.kind != "choice" else "choice: " + " | ".join(setting.choices)
    try:
        current = setting.raw()
        value = "unset" if current is None else f"{current!r} -> {setting.parse(current)!r}"
    except ValueError as exc:
        value = f"invalid: {exc}"
    return dict(
        name=setting.name,
        kind=kind,
        default="unset" if setting.default is None else repr(setting.default),
        current=value,
        meaning=setting.meaning,
        read=setting.read_when,
    )
