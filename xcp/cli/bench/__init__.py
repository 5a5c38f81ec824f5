"""``xcp bench``: ring overhead, memory and graph-capture figures measured side by side in one process, so
that the ring's cost over one whole-sequence kernel is known before it is run on many devices.

The overhead ratio is the forward(+backward) time of ring attention over a LocalWorld of P virtual ranks on
one device, divided by the time of the backend's own kernel on the whole sequence (the same total work,
and with a causal mask the same causal work): the ring's cost over ideal. Virtual ranks are threads, each
on its own stream, driving :func:`xcp.ring_forward` / :func:`xcp.ring_backward` directly (on a GPU,
autograd runs every backward on one device thread, where a rank waiting for its neighbour would block the
others). Nothing here asserts anything about time.

One module per measurement: :mod:`.dense` (the default grid, memory, graph capture), :mod:`.documents` and
:mod:`.window` (``--documents``, ``--window``), :mod:`.hybrid` (``--ulysses``), :mod:`.replay`
(``--replay``), :mod:`.host` (``--host``), :mod:`.world_of_one` (``--world-of-one``), :mod:`.distributed`
(``--distributed``, real ranks under torchrun), :mod:`.decode` (``--decode``), :mod:`.recurrent`
(``--recurrent``) and :mod:`.serve` (``--serve``: the paged, ragged decode; its yardstick in
:mod:`.serve_yardstick`). They share :mod:`.config` (what to measure), :mod:`.virtual` (the virtual ranks),
:mod:`.timing` (check, then time against the yardstick) and :mod:`.report`; :mod:`.runner` picks the mode and
:mod:`.command` is the subcommand.
"""

from __future__ import annotations

from .command import add_parser, command
from .config import REPLAY_FLAG, SIZE_FLAGS, BenchConfig
from .dense import plot_report
from .runner import format_report, run_bench
from .timing import ratio
from .virtual import VirtualRing

__all__ = [
    "REPLAY_FLAG",
    "SIZE_FLAGS",
    "BenchConfig",
    "VirtualRing",
    "add_parser",
    "command",
    "format_report",
    "plot_report",
    "ratio",
    "run_bench",
]
