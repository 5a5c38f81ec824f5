"""The recurrent layers' part of xcp's generate cache: each layer's conv and recurrent states kept whole on
every rank (:class:`ShardedStates`).

A recurrent mixer (Mamba, Mamba2, gated delta rule, KDA, short convolutions) keeps O(1) state per sequence
in transformers' linear-attention cache layer: the last inputs of its convolution(s) (``conv_states``) and
its recurrent state (``recurrent_states``). While the prompt's prefix goes through the ring, the mixer runs
on its shard with state passing (:mod:`xcp.integrations.transformers_recurrent`), whose final state is
already the whole sequence's on every rank; the convolution's last inputs are the whole sequence's last
ones, held by the owner of its last piece, which :func:`xcp.recurrent.last_inputs` hands to every rank.
After that every rank advances the states with the model's own kernels on the same tokens: no state
passing and no communication for these layers.

This module imports transformers (:mod:`xcp.integrations.transformers_generate` imports it only when
generating).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

from ..recurrent import last_inputs
from .transformers_unchangeable import Unchangeable


class ShardedStates(Unchangeable, LinearAttentionLayer, CacheLayerMixin):
    """One recurrent layer's states in xcp's generate cache: transformers' :class:`LinearAttentionLayer`
    (the mixers read and write it as they do on one device), with the prompt's ring prefix filled from the
    whole sequence, and the count of the tokens it has seen (``get_seq_length``: generate asks the cache
    how much of the prompt it holds, also of a model with no attention layer)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False
    is_sliding = False
    _holds = "xcp's generate cache of a recurrent layer (every rank keeps its states in step)"

    def __init__(self, group: Any, balance: str, number_of_states: int = 1) -> None:
        CacheLayerMixin.__init__(self)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        self.group, self.balance = group, balance
        self.ring = False  # True while the prompt's shard goes through the ring
        self.tokens = 0

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """The states' (keyword arguments, as ``update_conv_state`` / ``update_recurrent_state`` call it)."""
        LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            "cache.update: expected no keys and values for a recurrent layer (its slot keeps conv and recurrent "
            "states); got an attention update, which the model's layer_types do not announce"
        )

    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Outside the ring, transformers' own. During the ring, ``conv_states`` (``[B, C, L]``) is this rank's
        shard of the convolution's inputs: the layer keeps the last ``conv_kernel_size`` inputs of the whole
        sequence and returns the shard unchanged (the convolution runs on it with its halo)."""
        if not self.ring:
            return super().update_conv_state(conv_states, state_idx, conv_kernel_size=conv_kernel_size, **kwargs)
        width = conv_kernel_size if conv_kernel_size is not None else self.conv_kernel_size[state_idx]
        if not isinstance(width, int) or width < 1:
            raise ValueError(
                f"conv_kernel_size: expected the convolution's width (a positive integer) with the prompt's shard of "
                f"its inputs; got {width!r}"
            )
        whole = last_inputs(conv_states, width, group=self.group, balance=self.balance, seq_dim=conv_states.dim() - 1)
        if not self.is_conv_states_initialized[state_idx]:
            LinearAttentionLayer.lazy_initialization(
                self, conv_states=whole, state_idx=state_idx, conv_kernel_size=width
            )
        kept = self.conv_states[state_idx]
        assert kept is not None
        kept.copy_(whole)
        self.has_previous_state[state_idx] = True
        return conv_states

    def advance(self, tokens: int) -> None:
        """The layer's mixer ran over ``tokens`` more tokens of the sequence."""
        self.tokens += tokens

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def __deepcopy__(self, memo: dict) -> ShardedStates:
        """A new, empty layer like this one; a layer that holds states cannot be copied (it is one rank's)."""
        if self.tokens or any(self.has_previous_state.values()):
            self._cannot("copying a layer that holds states")
        return type(self)(self.group, self.balance, self.number_of_states)
