"""Inference over keys and values sharded across the ranks of a group: the wing of xcp that serves.

- :mod:`.cache`: :class:`xcp.KVCache`, one batch of equal-length sequences (prefill, append, attention);
- :mod:`.paged`: :class:`xcp.PagedKVCache`, many sequences in blocks (serving's continuous batches);
- :mod:`.paged_decode`: :class:`xcp.PagedDecode`, a ragged decode step over one, planned on the host into
  buffers on the device and run by device ops alone (captured once per padded batch size);
- :mod:`.partials`: what both share: a rank's local partial over segments, the packed all-gather with its
  hand-off, the merge, and :func:`xcp.combine` for an engine's own partials;
- :mod:`.plan` (where a KV cache keeps each token, the kernel calls of a local partial, the combine's bytes),
  :mod:`.state` (a preallocated cache's lengths on the device) and :mod:`.serving` (the paged placement,
  ``local_lengths``): pure plans and bookkeeping, below the rest.

Nothing is imported here: the plans load without the caches (docs/inference.md, docs/serving.md).
"""
