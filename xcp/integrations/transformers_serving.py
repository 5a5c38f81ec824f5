"""transformers' continuous batching over :class:`xcp.PagedKVCache`: :func:`generate_batch`.

``model.generate_batch(inputs, generation_config=...)`` schedules requests of any prompt length as transformers
schedules them (chunks of prompts beside other requests' decode steps, each request leaving at eos or
``max_new_tokens``) and runs every step as one packed batch. Here the same scheduler runs on every rank, in the
caller's thread (transformers runs it in a thread of its own, which a LocalWorld's virtual rank cannot lend its
group), and every layer's attention goes to a :class:`xcp.PagedKVCache` over the group, one per layer: the step's
new keys and values are appended (each rank keeps its own positions of every request), the step's queries attend
over each request's cache with one all-gather per layer, and a request that leaves frees its blocks. Every rank
runs the whole model on the same tokens and gets the same attention output, so greedy decoding picks the same
tokens on every rank.

transformers still sizes and allocates its own paged cache (its scheduler counts its blocks), which this
leaves unwritten; prefix sharing between requests is turned off (a request that reused another's cached prefix
would skip tokens this cache never saw).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..inference.paged import PagedKVCache
from ..inference.serving import held

_local = threading.local()  # this thread's _Serving, while a generate_batch runs in it
_lock = threading.Lock()
_users: dict[int, tuple[int, str]] = {}  # id(config) -> (generate_batch calls running, its own implementation)


@dataclasses.dataclass
class _Serving:
    """One rank's state of a generate_batch: the group, a paged cache per layer, the batch processor."""

    group: Any
    processor: Any
    num_blocks: int
    block_size: int
    caches: dict[int, PagedKVCache] = dataclasses.field(default_factory=dict)

    def batch_ids(self) -> list[str]:
        """The request ids of the step being computed, in the packed order."""
        return [fs.state.request_id for fs in self.processor.inputs_and_outputs.requests_in_batch]

    def cache(self, layer: int) -> PagedKVCache:
        if layer not in self.caches:
            self.caches[layer] = PagedKVCache(self.group, num_blocks=self.num_blocks, block_size=self.block_size)
        return self.caches[layer]

    def free(self, request_id: str) -> None:
        for cache in self.caches.values():
            if request_id in cache.seq_ids():
                cache.free(request_id)


def serving_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """The attention of one layer for one packed step: query [1, H, T, D], key and value [1, Hkv, T, D] of the
    step's new tokens (transformers' cache leaves them as they are); returns [1, T, H, Dv]."""
    state: _Serving | None = getattr(_local, "serving", None)
    if state is None:
        raise RuntimeError(
            "serving_attention: expected a call inside xcp.integrations.transformers.generate_batch; got one outside"
        )
    if getattr(module, "attn_logit_softcapping", None) or getattr(module.config, "attn_logit_softcapping", None):
        raise NotImplementedError(f"{type(module).__name__}: logit soft-capping is not served by xcp.PagedKVCache")
    ids = state.batch_ids()
    cu = kwargs["cu_seq_lens_q"][: len(ids) + 1].tolist()
    t = cu[-1]
    q, k, v = (x[0, :, :t].transpose(0, 1) for x in (query, key, value))
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)  # a query sees W keys: its own

    sinks = getattr(module, "sinks", None)
    cache = state.cache(int(module.layer_idx))  # type: ignore[arg-type]
    cache.append(ids, k, v, cu)
    out = cache.attention(q, ids, cu, scale=scaling, window=None if window is None else (window - 1, 0),
                          sinks=None if sinks is None else sinks.detach())  # fmt: skip
    assert isinstance(out, torch.Tensor)
    return out.unsqueeze(0), None


def _dispatching(original: Any) -> Any:
    """An attention function that is :func:`serving_attention` in a thread running a generate_batch and
    ``original`` in every other thread."""

    def attention(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "serving", None) is not None:
            return serving_attention(module, *args, **kwargs)
        return original(module, *args, **kwargs)

    attention.xcp_original = original  # type: ignore[attr-defined]
    return attention


@contextlib.contextmanager
def _serving(model: Any) -> Iterator[Callable[[], None]]:
    """While any generate_batch runs (ranks of a LocalWorld share one model): the implementations continuous
    batching switched the model to dispatch to :func:`serving_attention` in the threads that run one (every
    other thread keeps transformers' function), and the model's own implementation comes back when the last
    one leaves. Yields ``dispatch()``, to call once transformers has switched the model."""
    from transformers import AttentionInterface

    config = model.config
    with _lock:
        count, before = _users.get(id(config), (0, config._attn_implementation))
        _users[id(config)] = (count + 1, before)

    def dispatch() -> None:
        name = config._attn_implementation
        with _lock:
            current = AttentionInterface._global_mapping[name]
            if not hasattr(current, "xcp_original"):
                AttentionInterface.register(name, _dispatching(current))

    try:
        yield dispatch
    finally:
        with _lock:
            count, before = _users[id(config)]
            if count > 1:
                _users[id(config)] = (count - 1, before)
            else:
                del _users[id(config)]
                if config._attn_implementation != before:
                    model.set_attn_implementation(before)
                if not _users:  # no generate_batch runs anywhere: transformers' own functions back
                    for name, fn in list(AttentionInterface._global_mapping.items()):
                        if hasattr(fn, "xcp_original"):
                            AttentionInterface.register(name, fn.xcp_original)


def generate_batch(model: Any, inputs: list[list[int]], group: Any = None, generation_config: Any = None,
                   **kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """``model.generate_batch(inputs, generation_config=...)`` with every layer's keys and values in a
    :class:`xcp.PagedKVCache` over ``group``; returns what it returns ({request_id: GenerationOutput}, in the
    order of ``inputs``), the same on every rank. Greedy decoding only (every rank must pick the same tokens).

    :param inputs: the prompts, lists of token ids.
    :param group: as for :func:`xcp.attention`.
    :param generation_config: as for ``model.generate_batch``; ``do_sample`` must be False.
    :param kwargs: ``max_new_tokens`` and ``continuous_batching_config`` (whose ``allow_block_sharing`` is
        turned off), as for ``model.generate_batch``.
    """
    from transformers import ContinuousBatchingConfig

    gen = model.generation_config if generation_config is None else generation_config
    if getattr(gen, "do_sample", False):
        raise NotImplementedError(
            "generation_config.do_sample: expected False (greedy: every rank picks the same token); got True"
        )
    if getattr(gen, "num_return_sequences", None) not in (None, 1):
        raise NotImplementedError(
            f"generation_config.num_return_sequences: expected 1; got {gen.num_return_sequences} (forked requests "
            "share blocks)"
        )
    if not inputs:
        return {}
    cb_config = kwargs.pop("continuous_batching_config", None) or ContinuousBatchingConfig()
    cb_config = dataclasses.replace(cb_config, allow_block_sharing=False, use_async_batching=False)
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    if kwargs:
        raise TypeError(
            f"generate_batch: expected only max_new_tokens and continuous_batching_config; got {sorted(kwargs)}"
        )
    from ..comm import resolve_group

    comm = resolve_group(group)
    with _serving(model) as dispatch:
        return _run(model, inputs, comm, gen, cb_config, max_new_tokens, dispatch)


def _run(model: Any, inputs: list[list[int]], comm: Any, gen: Any, cb_config: Any, max_new_tokens: Any,
         dispatch: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
    """transformers' scheduler driven in this thread, attention by :func:`serving_attention`."""
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config)
    manager._original_attn_impl = None  # the last rank to leave puts the model's own back (_serving)
    dispatch()
    try:
        ids = manager.add_requests(inputs=inputs, max_new_tokens=max_new_tokens)
        processor = manager._create_batch_processor()
        manager.batch_processor = processor
        pool = processor.cache
        block_size = getattr(cb_config, "page_size", None) or 16
        state = _Serving(comm, processor, _pool_blocks(inputs, max_new_tokens or gen.max_new_tokens, pool.num_blocks,
                                                       comm.size(), block_size), block_size)  # fmt: skip
        pool.update = lambda key, value, layer_idx, kwargs=None: (key, value)  # xcp's caches keep them
        free = pool.free_blocks

        def free_both(request_id: str, no_cache: bool = False) -> None:
            free(request_id, no_cache)
            state.free(request_id)

        pool.free_blocks = free_both
        results: dict[str, Any] = {}
        _local.serving = state
        try:
            with torch.no_grad():
                while processor.prepare_next_batch():
                    manager._generation_step()
                    processor.update_batch()
                    while not manager.output_router.output_queue.empty():
                        out = manager.output_router.output_queue.get()
                        if out.is_finished():
                            results[out.request_id] = out
        finally:
            _local.serving = None
    finally:
        manager.destroy()
    return {i: results[i] for i in ids if i in results}


def _pool_blocks(inputs: list[list[int]], new: int | None, theirs: int, world: int, block_size: int) -> int:
    """Each rank's blocks: room for every request at its longest (prompt and ``new`` tokens) at once, as rank 0
    holds the most of each; without ``new``, transformers' own pool shared out (a request wastes at most one
    block). Sliding layers keep every token here (transformers' scheduler may admit more than its pool holds
    of full layers, since it drops what slides out)."""
    if new is None:
        return math.ceil(theirs / world) + len(inputs)
    return sum(-(-held(len(p) + new, world, 0) // block_size) for p in inputs)


def left_padding(mask: Any, input_ids: torch.Tensor) -> list[int] | None:
    """Each row's left padding in ``mask`` (a [B, L] tensor of 0 / 1 where 0 pads), or None where nothing is
    padded; refuses padding that is not on the left or a row of padding alone."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(input_ids.shape):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} (that of input_ids); got {got}")
    real = mask.bool()
    if bool(real.all()):
        return None
    pads = (~real).long().cumprod(dim=1).sum(dim=1)  # the zeros before a row's first 1
    held = real.long().sum(dim=1)
    for row, (pad, n) in enumerate(zip(pads.tolist(), held.tolist())):
        if n == 0 or pad + n != mask.shape[1]:
            why = "no token" if n == 0 else "padding after a token (right or inner padding)"
            raise ValueError(
                f"attention_mask: expected left padding (zeros, then ones, in every row); got {why} in row {row}"
            )
    return pads.tolist()


def generate_ragged(run: Any, model: Any, input_ids: torch.Tensor, pads: list[int], group: Any, max_new_tokens: int,
                    balance: str, kwargs: dict[str, Any]) -> torch.Tensor:  # fmt: skip
    """A left-padded batch generated one row at a time: each row's tokens without its padding through ``run``
    (xcp's generate of one prompt), then laid out as ``model.generate`` lays out the batch: each row's padding on
    its left, the pad token after its end where it ended before the longest. Greedy decoding, token ids only."""
    gen = kwargs.get("generation_config") or model.generation_config
    for name, refused in (("do_sample", True), ("return_dict_in_generate", True)):
        if kwargs.get(name, getattr(gen, name, None)) == refused:
            raise NotImplementedError(
                f"{name}: expected False with a left-padded attention_mask (its rows are generated one at a time: "
                f"greedy, token ids only); got {refused}"
            )
    rest = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    rows = [
        run(model, input_ids[i : i + 1, pad:], group, max_new_tokens, balance, dict(rest)) for i, pad in enumerate(pads)
    ]
    pad_id = kwargs.get("pad_token_id", gen.pad_token_id)
    if pad_id is None:  # transformers pads ended rows with the (first) eos token then
        eos = kwargs.get("eos_token_id", gen.eos_token_id)
        pad_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    new = max(r.shape[1] - (input_ids.shape[1] - pad) for r, pad in zip(rows, pads))
    out = input_ids.new_full((input_ids.shape[0], input_ids.shape[1] + new), 0 if pad_id is None else int(pad_id))
    for i, (r, pad) in enumerate(zip(rows, pads)):
        out[i, :pad] = input_ids[i, :pad]
        out[i, pad : pad + r.shape[1]] = r[0]
    return out


__all__ = ["generate_batch", "generate_ragged", "left_padding", "serving_attention"]
