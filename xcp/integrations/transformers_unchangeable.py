"""What the caches of xcp's generate refuse: the edits transformers' generate asks of a cache layer (beam
search's reordering, assisted decoding's crop, batch expansion), which a layer whose contents are one rank's
share (keys and values) or kept in step by every rank (recurrent states) cannot follow."""

from __future__ import annotations

import torch


class Unchangeable:
    """A cache layer's refusals of transformers' edits, each naming the edit and the cache (``_holds``)."""

    _holds = "xcp's sharded KV cache (each rank holds only its share)"

    def _cannot(self, what: str) -> None:
        raise NotImplementedError(f"{what}: not supported by {self._holds}")

    def crop(self, tokens_to_remove: int) -> None:
        self._cannot("crop")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._cannot("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._cannot("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._cannot("batch_select_indices")

    def reset(self) -> None:
        self._cannot("reset")
