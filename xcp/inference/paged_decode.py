"""A graph-safe decode step of a ragged batch over a :class:`xcp.PagedKVCache`: planned on the host, run on the device.

A serving engine's decode step is the same kernels at every step while the lengths grow, requests come and go
and their blocks come from the pool; only the metadata changes. So the step splits in two (docs/serving.md):

- :meth:`PagedDecode.plan` (host, eager): one token for each listed request, its blocks taken from the pool as
  :meth:`xcp.PagedKVCache.append` takes them (every rank's counted first), and the step's metadata written into
  buffers that live on the device for good: each row's pool slot for its new token, its block table, its local
  length after the step. The batch is padded up to a captured size: a padded row writes its token into the
  pool's sink block (:attr:`xcp.PagedKVCache.sink_block`, never any sequence's), sees no key and comes out 0.
- :meth:`PagedDecode.step` (device only): the new keys and values written into their slots, the local partial
  through :meth:`xcp.Backend.forward_paged` over the device's tables and lengths, and the combine (one all-gather,
  the merge). The host reads no value and the shapes depend on the padded size alone, so one device graph
  captured per padded size replays every later step of that size.

Lifetimes (docs/lifetime.md): the metadata buffers are made once, at the first plan, before any capture (rule
4: nothing allocated while capturing); the plan's host-to-device copies go on the current stream, ordered after
every step issued before on it and before the next; the combine hands the packed partial over as
:class:`xcp.PagedKVCache` does (rule 3.3).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..checks import check_scale
from ..kernels.merge import accumulator_dtype
from ..plugins import select_backend
from . import partials
from .paged import PagedKVCache
from .serving import held


def padded_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a step is padded up to: powers of two below ``max_batch``, and ``max_batch``."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return (*sizes, max_batch)


class PagedDecode:
    """Decode steps of a ragged batch over ``cache``, one token per listed request, capturable per padded size.

    :param cache: this rank's :class:`xcp.PagedKVCache` (its pool made: a first :meth:`~xcp.PagedKVCache.append`
        with tokens done, e.g. the first prefill).
    :param max_batch: the most requests of a step.
    :param max_len: the most tokens any request reaches; fixes the block tables' width on the device.
    :param scale: factor on q·k; default 1/sqrt(head_dim).
    :param sizes: the padded batch sizes (ascending, the last ``max_batch``); default :func:`padded_sizes`.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        *,
        max_batch: int,
        max_len: int,
        scale: float | None = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected an xcp.PagedKVCache; got {type(cache).__name__}")
        for name, value in (("max_batch", max_batch), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer; got {value!r}")
        self.sizes = padded_sizes(max_batch) if sizes is None else tuple(sizes)
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[-1] != max_batch or (
            self.sizes[0] < 1
        ):  # fmt: skip
            raise ValueError(f"sizes: expected ascending distinct sizes >= 1 ending at max_batch = {max_batch}; "
                             f"got {list(self.sizes)}")  # fmt: skip
        self.cache, self.max_batch, self.max_len, self._scale = cache, max_batch, max_len, scale
        world, interleave = cache._world, cache.interleave
        self.width = -(-held(max_len, world, 0, interleave) // cache.block_size)  # rank 0 holds the most
        """Blocks of a row of the device's block table: what the longest request needs on the busiest rank."""
        self.max_keys = self.width * cache.block_size
        self._buffers: dict[str, torch.Tensor] | None = None
        self._pending = False  # a plan not yet stepped (eagerly, or by the capture of a graph)
        self.batch = 0
        """The padded size of the last :meth:`plan` (the size :meth:`step` takes)."""

    # ------------------------------------------------------------------ host
    def plan(self, seq_ids: Sequence[Hashable]) -> int:
        """Give each listed request (held by the cache) one more token, its blocks from the pool, and write the
        step's metadata into the device's buffers; return the padded batch size, the rows :meth:`step` takes.

        Raises before changing anything: an unknown id (KeyError naming ``seq_id``), more than ``max_batch``
        requests, a request past ``max_len``, or a step some rank's pool cannot hold (ValueError naming
        ``num_blocks``, on every rank, as an append)."""
        cache = self.cache
        cache._refuse_capture("plan", cache._k.device if cache._k is not None else torch.device("cpu"))
        if cache._k is None:
            raise ValueError("cache: expected a pool that holds tokens (append a first prefill before decoding); "
                             "got a cache with no pool yet")  # fmt: skip
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, (list, tuple)):
            raise TypeError(f"seq_ids: expected a list or tuple of sequence ids; got {type(seq_ids).__name__}")
        ids = tuple(seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids: expected distinct ids; got {list(ids)}")
        if not 1 <= len(ids) <= self.max_batch:
            raise ValueError(f"seq_ids: expected 1 to max_batch = {self.max_batch} requests; got {len(ids)}")
        for i in ids:
            n = cache.seq_len(i) + 1  # KeyError naming seq_id for a request the cache does not hold
            if n > self.max_len:
                raise ValueError(f"max_len: expected every request to stay within PagedDecode(max_len="
                                 f"{self.max_len}); got {i!r} reaching {n} tokens")  # fmt: skip
        rows, sources = cache._place(ids, tuple(range(len(ids) + 1)))
        batch = next(s for s in self.sizes if s >= len(ids))
        sink = cache.sink_block
        slots = [sink * cache.block_size] * batch
        for row, source in zip(rows, sources):
            slots[source] = row
        table = [[sink] * self.width for _ in range(batch)]
        used = [0] * batch
        for i, seq_id in enumerate(ids):
            blocks = cache.block_table(seq_id)
            table[i][: len(blocks)] = blocks
            used[i] = cache.local_len(seq_id)
        self._upload(slots, table, used)
        self.batch, self._pending = batch, True
        return batch

    def _upload(self, slots: list[int], table: list[list[int]], used: list[int]) -> None:
        """The plan's metadata into the device's buffers (made at the first plan, never again), from pinned memory
        on the current stream: ordered after the steps issued before and before the next."""
        device = self.cache._k.device  # type: ignore[union-attr]
        if self._buffers is None:
            self._buffers = {
                "slots": torch.zeros(self.max_batch, dtype=torch.int64, device=device),
                "table": torch.zeros((self.max_batch, self.width), dtype=torch.int32, device=device),
                "used": torch.zeros(self.max_batch, dtype=torch.int32, device=device),
                "cu_q": torch.arange(self.max_batch + 1, dtype=torch.int32, device=device),
            }
        pinned = device.type != "cpu"
        for name, values, dtype in (("slots", slots, torch.int64), ("table", table, torch.int32),
                                    ("used", used, torch.int32)):  # fmt: skip
            host = torch.tensor(values, dtype=dtype)
            if pinned:
                host = host.pin_memory()  # the caching host allocator keeps it until the copy is done
            self._buffers[name][: len(values)].copy_(host, non_blocking=pinned)

    # ------------------------------------------------------------------ device
    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """The planned step on the device: each row's new key and value written into its slot, then its query's
        attention over its request's tokens on every rank, combined; the same on every rank.

        :param q: [batch, H, D], ``batch`` the size :meth:`plan` returned; row i the newest query of the i-th
            listed request, the rows after them padding (any finite values).
        :param k: [batch, Hkv, D], the new keys (the same on every rank, as for an append).
        :param v: [batch, Hkv, Dv], or None where the cache keeps ``values_in_keys``.
        :returns: [batch, H, Dv] in q's dtype: each request's attention; padded rows exactly 0.

        Reads no tensor's value on the host; its kernels depend on ``batch``, dtypes and the cache's shapes alone,
        so a device graph captured around it replays every later step planned to the same ``batch``."""
        cache, buffers = self.cache, self._buffers
        if buffers is None or not self._pending:
            raise RuntimeError("step: expected a plan first (PagedDecode.plan(seq_ids)); got none since the last step "
                               "(a replayed graph of a step needs no call: plan, then replay)")  # fmt: skip
        assert cache._k is not None and cache._v is not None and cache._layout is not None
        b = self.batch
        _, hkv, d, dtype, _, dv = cache._layout
        heads = q.shape[1] if q.dim() == 3 and q.shape[1] % hkv == 0 else "a multiple of " + str(hkv)
        checked = [("q", q, (b, heads, d)), ("k", k, (b, hkv, d))] + ([("v", v, (b, hkv, dv))] if v is not None else [])
        for name, x, shape in checked:
            if tuple(x.shape) != shape or x.dtype != dtype or x.device != cache._k.device:
                raise ValueError(f"{name}: expected {list(shape)} {dtype} on {cache._k.device} (the plan's batch and "
                                 f"the pool's); got {list(x.shape)} {x.dtype} on {x.device}")  # fmt: skip
        if (v is None) != (cache.values_in_keys is not None):
            got = "None" if v is None else "a tensor"
            raise ValueError(f"v: expected None exactly where the cache keeps values_in_keys; got {got} with "
                             f"values_in_keys={cache.values_in_keys}")  # fmt: skip
        self._pending = False
        slots, pool_k, pool_v = buffers["slots"][:b], cache._k, cache._v
        pool_k.view(-1, hkv, d).index_copy_(0, slots, k)  # a padded row's (or another rank's) token: the sink
        if v is not None:
            pool_v.view(-1, hkv, dv).index_copy_(0, slots, v)
        backend = select_backend(cache._device, q.device.type)
        scale = check_scale(self._scale, d)
        table, cu_q, used = buffers["table"][:b], buffers["cu_q"][: b + 1], buffers["used"][:b]

        def partial(packed_dtype: torch.dtype) -> torch.Tensor:
            out, lse = backend.forward_paged(q, pool_k, pool_v, table, cu_q, used, 1, self.max_keys, scale)
            return partials.pack(out[None], lse[None], packed_dtype)

        h = q.shape[1]
        if cache._world == 1:
            out, _ = partials.unpack(partial(accumulator_dtype(q.dtype)), dv)
        else:
            out, _ = partials.gather_merge(cache._comm, backend, cache._handoff, lambda: partial(q.dtype),
                                           (1, b, h, dv), q.dtype, q.device)  # fmt: skip
        return out[0].to(q.dtype)

    def __repr__(self) -> str:
        return f"<PagedDecode of {self.cache!r}: sizes {list(self.sizes)}, max_len {self.max_len}>"


def decode_padding(batch: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` (rows of the listed requests) padded with zero rows up to ``batch``."""
    return [torch.cat([x, x.new_zeros((batch - x.shape[0], *x.shape[1:]))]) for x in tensors]


__all__ = ["PagedDecode", "decode_padding", "padded_sizes"]
