"""Context parallelism for recurrent layers (state-space, linear attention, short convolutions).

:func:`state_passing` runs a layer's chunk kernel over a sharded sequence exactly (two passes around one
all-gather of per-piece state summaries); :func:`causal_conv` runs a causal convolution with the halo
each piece needs; :func:`last_inputs` gives every rank the sequence's last inputs (a convolution's cache
after a prompt). See docs/hybrid.md.
"""

from .conv import causal_conv, last_inputs
from .layout import RECURRENT_BALANCES, Piece, check_recurrent_balance, plan_pieces
from .state import Decay, DeltaRule, Kernel, Transition, state_passing

__all__ = [
    "RECURRENT_BALANCES",
    "Decay",
    "DeltaRule",
    "Kernel",
    "Piece",
    "Transition",
    "causal_conv",
    "last_inputs",
    "check_recurrent_balance",
    "plan_pieces",
    "state_passing",
]
