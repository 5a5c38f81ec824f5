"""transformers' recurrent layers whose recurrence is written inline in the mixer's forward, made
context-parallel: adapters in :func:`prepare`'s registry.

These mixers (MiniMax's lightning attention, RecurrentGemma's RG-LRU, RWKV's WKV and token shift, ZAYA's CCA
projection, xLSTM's mLSTM, whose backend the layer calls as a module) call no module-level kernel a dispatcher
could swap (:mod:`xcp.integrations.transformers_recurrent`), so each family has here its recurrence as a chunk
kernel of the ``initial_state`` / ``output_final_state`` convention (its own method or function where it has one
with an initial state) and a forward that runs the mixer's own code around it, the kernel through
:func:`xcp.recurrent.state_passing` (and short convolutions through :func:`xcp.recurrent.causal_conv`). The
adapter binds a forward to each mixer instance that takes this path only under an :func:`xcp.context` of more
than one rank; anywhere else the mixer's own forward runs unchanged. Under xcp's generate every family keeps
its states whole on every rank where its own generate keeps them (:data:`GENERATES`; RWKV's and xLSTM's models
through :data:`MODELS`). tests/test_recurrent_transformers.py checks each family against the model on one device.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..context import current
from ..recurrent import Decay, causal_conv, check_recurrent_balance, last_inputs, state_passing
from . import decoding
from .transformers_prepare import register_layer
from .transformers_recurrent import mixer_documents


@dataclass(frozen=True)
class Run:
    """What a mixer's context-parallel forward needs from the context: its group and balance, and the layer's
    class name for errors."""

    group: Any
    balance: str
    layer: str
    final: bool = False  # the state after the sequence wanted too (xcp's generate, the prompt's ring prefix)
    ulysses: int = 1  # the context's U: the tokens placed as xcp.shard(..., ulysses=U) places them
    documents: tuple[int, ...] | None = None  # the packed documents' GLOBAL boundaries (None: one sequence)

    @property
    def where(self) -> dict[str, Any]:
        """The layout keywords of :func:`xcp.recurrent.state_passing` and its kin: group, balance, ulysses."""
        return {"group": self.group, "balance": self.balance, "ulysses": self.ulysses}

    def with_documents(self, kwargs: dict[str, Any]) -> Run:
        """This run with the packed documents the mixer was called with (``cu_seq_lens_q/k``): its recurrence
        restarts and its convolution's halo stops at each (:func:`mixer_documents`)."""
        return replace(self, documents=mixer_documents(self.layer, kwargs))

    def refuse_carried(self, what: str, value: Any) -> None:
        """A state from a cache (a continued sequence) has no place in state passing, which starts at zero."""
        if value is not None:
            raise NotImplementedError(
                f"{self.layer}: {what} under an xcp.context of more than one rank is not supported (state passing "
                "starts the sequence from a zero state): pass use_cache=False and the whole sequence at once"
            )


def _prompt(cache: Any) -> bool:
    """Whether ``cache`` is xcp's generate cache during the prompt's ring prefix (where a family of
    :data:`GENERATES` keeps the whole sequence's states in it)."""
    return cache is not None and type(cache).__name__ == "ShardedCache" and bool(cache.ring)


def _generating() -> Any:
    """xcp's generate cache of this thread (None outside ``xt.generate``): found through the decoder generate
    set, since RWKV's and xLSTM's layers are handed no cache."""
    cache = decoding.cache()
    return cache if type(cache).__name__ == "ShardedCache" else None


ContextParallel = Callable[..., Any]
"""``forward(module, run, *args, **kwargs)``: a mixer's forward over the context's ranks."""

FAMILIES: dict[str, ContextParallel] = {}
"""The mixer classes (transformers 5.24) served here, by name, with their context-parallel forward."""


def _forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """An adapted mixer's forward (bound to the instance): its class's forward on one rank, the family's
    context-parallel forward under a context of more than one rank; under xcp's generate the family's forward
    for the prompt's ring prefix (on any number of ranks: it fills xcp's cache), its step after it."""
    ctx = current()
    layer = type(self).__name__
    cache = _generating()
    if cache is not None and layer in GENERATES and not cache.ring:
        # xcp's generate after the prompt's ring prefix: the same tokens on every rank, the states whole
        return GENERATES[layer](self, cache, *args, **kwargs)
    if ctx.world_size == 1 and not (cache is not None and layer in GENERATES):  # (the ring prefix of one rank
        return type(self).forward(self, *args, **kwargs)  # fills xcp's cache as that of several does)
    if decoding.current() is not None and (cache is None or layer not in GENERATES):
        raise NotImplementedError(
            f"{layer}: xcp.integrations.transformers.generate over more than one rank does not serve this "
            "recurrent layer yet (its state would have to be kept whole on every rank after the prompt); "
            "generate on one rank"
        )
    run = Run(ctx.group, check_recurrent_balance(ctx.balance), layer, ulysses=ctx.ulysses)
    return FAMILIES[layer](self, run, *args, **kwargs)


def _adapt(module: torch.nn.Module) -> None:
    module.forward = types.MethodType(_forward, module)


def _modeling(module: torch.nn.Module) -> Any:
    """The modeling module of ``module``'s class (its helper functions, as the mixer itself calls them)."""
    return sys.modules[type(module).__module__]


class _Active(threading.local):
    """The run of the mixer this thread is in (None: outside one), for the pieces swapped into its children;
    the final state its scan handed back last (RecurrentGemma's RG-LRU under xcp's generate)."""

    run: Run | None = None
    final: Any = None


_active = _Active()


@contextmanager
def _running(run: Run) -> Iterator[None]:
    before, _active.run = _active.run, run
    try:
        yield
    finally:
        _active.run = before


def _with_halo(module: torch.nn.Module, width: int, seq_dim: int) -> None:
    """Make ``module`` (a causal convolution or token shift along ``seq_dim`` over a window of ``width``
    tokens; its output's first positions are the causal ones) take its halo under a run: its own forward
    on each piece with the ``width - 1`` tokens before it, keeping as many outputs as it was given."""
    forward = type(module).forward

    def halo_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        run = _active.run
        if run is None:
            return forward(self, x)

        def causal(part: torch.Tensor) -> torch.Tensor:
            return forward(self, part).narrow(seq_dim, 0, part.shape[seq_dim])

        return causal_conv(causal, x, width, **run.where, cu_seqlens=run.documents, seq_dim=seq_dim)

    module.forward = types.MethodType(halo_forward, module)


# --------------------------------------------------------------------------------------------------------
# MiniMax: lightning attention


def lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    slope: torch.Tensor,
    block: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning attention, blockwise: per head ``h_t = exp(-slope) h_{t-1} + k_tᵀ v_t``, ``o_t = q_t h_t``.

    :param q: queries, keys ``k`` and values ``v`` ``[B, L, H, D]``; ``slope`` ``[H, 1, 1]``.
    :param initial_state: the state ``[B, H, D, D]`` before the first token (None: zeros).
    :returns: ``(out [B, L, H, D], final state or None)``.
    """
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    batch, heads, length, dim = q.shape
    h = initial_state if initial_state is not None else q.new_zeros((batch, heads, dim, v.shape[-1]))
    outs = []
    for start in range(0, length, block):
        qb, kb, vb = (x[:, :, start : start + block] for x in (q, k, v))
        n = qb.shape[2]
        steps = torch.arange(1, n + 1, device=q.device, dtype=slope.dtype)
        gap = steps[:, None] - steps[None, :]
        within = torch.exp(-slope * gap.clamp_min(0)) * (gap >= 0)  # exp(-slope (i - j)) for j <= i
        scores = (qb @ kb.transpose(-1, -2)) * within.to(qb.dtype)
        carried = (qb * torch.exp(-slope * steps[:, None]).to(qb.dtype)) @ h
        outs.append(scores @ vb + carried)
        to_end = torch.exp(-slope * (n - steps)[:, None]).to(kb.dtype)
        h = h * torch.exp(-slope * n).to(h.dtype) + (kb * to_end).transpose(-1, -2) @ vb
    out = torch.cat(outs, dim=2).transpose(1, 2)
    return out, (h if output_final_state else None)


def _minimax(self: Any, run: Run, hidden_states: torch.Tensor, position_embeddings: Any = None,
             attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
    """``MiniMaxLightningAttention.forward`` over the ranks: its projections, output norm and gate as the
    mixer's own; the recurrence through state passing (the state decays by ``exp(-slope)`` per token)."""
    run = run.with_documents(kwargs)
    prompt = _prompt(cache)
    if prompt:  # xcp's generate: the whole prompt's state into its slot of xcp's cache, on every rank
        cache = _LinearStates(cache)
    if cache is not None:
        run.refuse_carried("a linear attention state from the cache", cache.get_linear_cache(self.layer_idx))
    batch, length, _ = hidden_states.shape
    heads, dim = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    qkv = _modeling(self).apply_mask_to_padding_states(qkv, attention_mask)
    q, k, v = torch.split(qkv.reshape(batch, length, heads, 3 * dim), dim, dim=3)
    slope = self.slope_rate

    def kernel(q, k, v, initial_state=None, output_final_state=False):
        final = output_final_state
        return lightning_attention(q, k, v, slope=slope, block=self.block_size, initial_state=initial_state,
                                   output_final_state=final)  # fmt: skip

    def decay(q, k, v):
        return torch.exp(-slope * q.shape[1])

    out, state = state_passing(
        kernel, q, k, v, transition=Decay(decay), **run.where, cu_seqlens=run.documents,
        output_final_state=cache is not None,
    )  # fmt: skip
    out = self.norm(out.reshape(batch, length, heads * dim))
    out = self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * out)
    if cache is not None:
        cache.set_linear_cache(self.layer_idx, state)
    if prompt:
        cache.sharded.advance(self.layer_idx, length * current().world_size)  # the ring prefix: P equal shards
    return out, state


class _LinearStates:
    """MiniMax's cache interface (its ``MiniMaxCache``'s ``get_linear_cache`` / ``set_linear_cache``) over xcp's
    generate cache: a lightning attention layer's state ``[B, H, D, D]`` is the recurrent state of its slot."""

    def __init__(self, sharded: Any) -> None:
        self.sharded = sharded

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        layer = self.sharded.layers[layer_idx]
        return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.sharded.layers[layer_idx].update_recurrent_state(state, 0)


def _minimax_step(self: Any, sharded: Any, /, *args: Any, **kwargs: Any) -> Any:
    """The mixer after the prompt's ring prefix under xcp's generate: its own forward over its state in xcp's
    cache (the same tokens on every rank; its decoder layer hands it the cache by keyword), the tokens counted."""
    out = type(self).forward(self, *args, **{**kwargs, "cache": _LinearStates(sharded)})
    sharded.advance(self.layer_idx, out[0].shape[1])
    return out


def _minimax_model(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``MiniMaxModel.forward``; under xcp's generate with ``use_cache`` off (MiniMax refuses any cache but its
    own while it is on, and its layers read and write the cache they are handed either way)."""
    if _generating() is not None and type(kwargs.get("cache")).__name__ == "ShardedCache":
        kwargs["use_cache"] = False
    return type(self).forward(self, *args, **kwargs)


FAMILIES["MiniMaxLightningAttention"] = _minimax


# --------------------------------------------------------------------------------------------------------
# RecurrentGemma: RG-LRU and its short convolution


def _recurrent_gemma(self: Any, run: Run, input_states: torch.Tensor, position_ids: torch.Tensor,
                     attention_mask: Any = None, use_cache: bool = True, **kwargs: Any) -> Any:  # fmt: skip
    """``RecurrentGemmaRecurrentBlock.forward`` over the ranks: the block's own code without its cache (it
    keeps its convolution and RG-LRU states in itself: refused with ``use_cache=True``), with the scan and
    the convolution swapped in by :func:`_adapt_recurrent_gemma` running through state passing and halos.
    The RG-LRU resets the state at position 0, which shard_batch's global positions give only the
    sequence's first token."""
    run = run.with_documents(kwargs)
    cache = kwargs.get("cache")
    prompt = _prompt(cache)
    if not prompt:
        run.refuse_carried("state (use_cache=True)", True if use_cache else None)  # kept in the block: per rank
    with _running(replace(run, final=prompt)):
        out = type(self).forward(self, input_states, position_ids, attention_mask, use_cache=False, **kwargs)
    if prompt:  # xcp's generate: the whole prompt's states, on every rank, in this rank's cache
        inputs = self.linear_x(input_states).transpose(1, 2)
        conv = last_inputs(inputs, self.conv1d_width - 1, **run.where, seq_dim=2)
        _block_states(cache)[self] = (conv, _active.final)  # the RG-LRU's final state, as its scan handed it
        _count(cache, input_states.shape[1] * current().world_size)  # the ring prefix: P equal shards
    return out


def _block_states(sharded: Any) -> dict[Any, tuple[Any, Any]]:
    """RecurrentGemma's states in xcp's generate cache, per block: ``(conv1d_state, the RG-LRU's
    recurrent_states)``. The blocks keep them in attributes of their own, which virtual ranks sharing one model
    would share: each rank keeps its own here and hands them to a block only while it runs (:data:`_STEP`)."""
    return sharded.kept.setdefault("recurrent_gemma", {})


_STEP = threading.Lock()
"""Held while a RecurrentGemma block runs a step over one rank's states (the step sends nothing)."""


def _count(cache: Any, seen: int) -> None:
    """Tell xcp's generate cache that its recurrent layers have seen ``seen`` tokens of the sequence (how much of
    the prompt it holds): RecurrentGemma's blocks keep no layer index, and every one sees the same tokens."""
    for index, layer in enumerate(cache.layers):
        if type(layer).__name__ == "ShardedStates" and seen > layer.get_seq_length():
            cache.advance(index, seen - layer.get_seq_length())


def _recurrent_gemma_step(self: Any, sharded: Any, /, *args: Any, **kwargs: Any) -> Any:
    """The block after the prompt's ring prefix under xcp's generate: its own forward over this rank's states
    (the whole sequence's, :func:`_block_states`; none yet where the prompt was too short for the ring: the
    block starts from zeros), and the tokens counted (``position_ids`` are global)."""
    position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
    states = _block_states(sharded)
    with _STEP:
        self.conv1d_state, self.rg_lru.recurrent_states = states.get(self, (None, None))
        out = type(self).forward(self, *args, **kwargs)
        states[self] = (self.conv1d_state, self.rg_lru.recurrent_states)
    _count(sharded, int(position_ids.max()) + 1)
    return out


def _rg_lru_scan(self: Any, hidden_states: torch.Tensor, recurrent_gate: torch.Tensor, reset: torch.Tensor,
                 recurrent_states: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """``RecurrentGemmaRglru._rnn_scan`` (``h_t = a_t h_{t-1} + x_t``, ``a_t`` zero at a reset), through state
    passing under a run; the state decays by the product of ``a_t`` over a stretch."""
    scan = type(self)._rnn_scan
    run = _active.run
    if run is None:
        return scan(self, hidden_states, recurrent_gate, reset, recurrent_states, **kwargs)

    def kernel(x, a, r, initial_state=None, output_final_state=False):
        return scan(self, x, a, r, initial_state, **kwargs)

    def decay(x, a, r):
        return (a * ~r).prod(dim=1)

    out, _active.final = state_passing(
        kernel, hidden_states, recurrent_gate, reset, transition=Decay(decay), **run.where,
        cu_seqlens=run.documents, output_final_state=run.final,
    )  # fmt: skip
    return out, _active.final


def _adapt_recurrent_gemma(module: torch.nn.Module) -> None:
    _adapt(module)
    rg_lru, conv = module.rg_lru, module.conv_1d
    rg_lru._rnn_scan = types.MethodType(_rg_lru_scan, rg_lru)  # type: ignore[union-attr]
    _with_halo(conv, int(conv.kernel_size[0]), seq_dim=2)  # type: ignore[index, union-attr, arg-type]


FAMILIES["RecurrentGemmaRecurrentBlock"] = _recurrent_gemma


# --------------------------------------------------------------------------------------------------------
# RWKV: the WKV recurrence and token shift


class RunningMax:
    """A state kept as its kernel keeps it, ``[..., n + 1]``: ``n`` values scaled by ``exp(-max)`` and that
    running maximum ``max`` last (RWKV's WKV numerator and denominator; xLSTM's mLSTM memory and normalizer).
    The true values ``x * exp(max)`` decay by ``T`` per stretch, kept as its logarithm (``T h`` adds it to
    ``max``); two states add under their larger maximum, never leaving the scaled form (no overflow).

    :param log_decay: ``log_decay(*inputs) -> log T`` of a stretch, broadcastable to ``[..., 1]``.
    :param identity: ``identity(*inputs) -> state`` that adds nothing (``max`` far below any), where the
        kernel given no initial state starts elsewhere (xLSTM: ``max`` 0; then ``start`` is that state).
    """

    def __init__(
        self, log_decay: Callable[..., torch.Tensor], identity: Callable[..., torch.Tensor] | None = None
    ) -> None:
        self.log_decay, self.identity = log_decay, identity
        if identity is not None:
            self.start = torch.zeros_like  # the kernel's own start: zeros, max 0

    def summarize(self, kernel: Any, inputs: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        given = None if self.identity is None else self.identity(*inputs)
        _, final = kernel(*inputs, initial_state=given, output_final_state=True, **kwargs)
        return self.log_decay(*inputs).to(final.dtype), final

    def apply(self, t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.cat((h[..., :-1], h[..., -1:] + t.to(h.dtype)), dim=-1)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        top = torch.maximum(a[..., -1:], b[..., -1:])
        scaled = a[..., :-1] * torch.exp(a[..., -1:] - top) + b[..., :-1] * torch.exp(b[..., -1:] - top)
        return torch.cat((scaled, top), dim=-1)


def _rwkv_attention(self: Any, run: Run, hidden: torch.Tensor, state: Any = None, use_cache: bool = False) -> Any:
    """``RwkvSelfAttention.forward`` over the ranks: its own token shift (with its halo) and projections, the
    WKV recurrence through state passing with its module's torch kernel (``rwkv_linear_attention_cpu``:
    the CUDA kernel's backward drops the initial state's gradient), the state ``[..., (num, den, max)]``.
    Under xcp's generate (the prompt's ring prefix) it writes the whole sequence's states into the model's
    ``state`` list, as the layer does on one device: its last input (the token shift's) and the WKV state."""
    prompt = _rwkv_prompt(run, state)
    with _running(run):
        receptance, key, value, _ = self.extract_key_value(hidden)
    wkv = _modeling(self).rwkv_linear_attention_cpu
    decay, first = self.time_decay, self.time_first

    def kernel(k, v, initial_state=None, output_final_state=False):
        given = None if initial_state is None else list(initial_state.unbind(-1))
        out, final = wkv(decay, first, k, v, state=given, return_state=True)
        return out, torch.stack(final, dim=-1)

    def log_decay(k, v):
        return (-torch.exp(decay.to(k.dtype)) * k.shape[1])[:, None]

    out, final = state_passing(
        kernel, key, value, transition=RunningMax(log_decay), **run.where, output_final_state=prompt
    )  # fmt: skip
    if prompt:
        assert final is not None
        state[1][:, :, self.layer_id] = last_inputs(hidden, 1, **run.where)[:, 0]
        for slot, part in zip(state[2:], final.unbind(-1)):
            slot[:, :, self.layer_id] = part
    return self.output(receptance * out), state if prompt else None


def _rwkv_prompt(run: Run, state: Any) -> bool:
    """Whether the layer runs the prompt's ring prefix of xcp's generate (the model's fresh ``state`` list to
    fill); else a state given is a carried one, refused."""
    if _prompt(_generating()):
        return True
    run.refuse_carried("state (use_cache=True)", state)
    return False


def _rwkv_feed_forward(self: Any, run: Run, hidden: torch.Tensor, state: Any = None) -> Any:
    """``RwkvFeedForward.forward`` over the ranks: its own code, its token shift taking its halo; under the
    prompt's ring prefix of xcp's generate, its last input (the token shift's state) into the model's state."""
    prompt = _rwkv_prompt(run, state)
    with _running(run):
        out, _ = type(self).forward(self, hidden)
    if prompt:
        state[0][:, :, self.layer_id] = last_inputs(hidden, 1, **run.where)[:, 0]
    return out, state if prompt else None


def _own_step(self: Any, sharded: Any, /, *args: Any, **kwargs: Any) -> Any:
    """A mixer after the prompt's ring prefix under xcp's generate whose states its model or cache hands it
    (ZAYA's from xcp's cache; RWKV's and xLSTM's from their model's own objects, which xcp's cache keeps): its
    own forward."""
    return type(self).forward(self, *args, **kwargs)


def _seen(sharded: Any, tokens: int) -> None:
    """Count ``tokens`` more tokens of the sequence in xcp's generate cache (the ring prefix's P equal shards)."""
    _count(sharded, sharded.get_seq_length() + tokens * (current().world_size if sharded.ring else 1))


def _rwkv_model(self: Any, input_ids: Any = None, attention_mask: Any = None, inputs_embeds: Any = None,
                state: Any = None, use_cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
    """``RwkvModel.forward``; under xcp's generate its ``state`` list is kept in xcp's cache (generate hands the
    model its own state only from the second new token on, and the model hands its blocks no cache): the
    prompt's ring prefix fills a fresh one with the whole sequence's states, later calls go on from it, and
    the tokens are counted."""
    sharded = _generating()
    if sharded is None:
        return type(self).forward(self, input_ids, attention_mask, inputs_embeds, state=state, use_cache=use_cache,
                                  **kwargs)  # fmt: skip
    batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
    if batch > 1:
        raise ValueError(
            f"input_ids: expected one prompt for {type(self).__name__} under xcp's generate; got a batch of {batch} "
            "(transformers' RWKV mixes the rows of a batch in its one-token step, [B, 1, H] + [B, H], its own "
            "generate too): generate one prompt at a time"
        )
    if state is None and not sharded.ring:
        state = sharded.kept.get("rwkv")
    out = type(self).forward(self, input_ids, attention_mask, inputs_embeds, state=state, use_cache=True, **kwargs)
    sharded.kept["rwkv"] = out.state if hasattr(out, "state") else out[1]
    _seen(sharded, (input_ids if input_ids is not None else inputs_embeds).shape[1])
    return out


def _adapt_rwkv(module: torch.nn.Module) -> None:
    _adapt(module)
    _with_halo(module.time_shift, 2, seq_dim=1)  # type: ignore[arg-type]


FAMILIES["RwkvSelfAttention"] = _rwkv_attention
FAMILIES["RwkvFeedForward"] = _rwkv_feed_forward

# --------------------------------------------------------------------------------------------------------
# ZAYA: the CCA projection's causal convolution over queries and keys, and its delayed values


class _Before:
    """What ZAYA's CCA projection reads from a cache to go on from earlier tokens, for one piece: its
    convolution's last inputs (``[B, C, K]``) and the previous token's delayed value (``[B, C_v]``).
    Updates are not kept (no cache over ranks)."""

    def __init__(self, conv: torch.Tensor, value: torch.Tensor) -> None:
        self.conv, self.value = conv, value

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.value

    def update_conv_state(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update_recurrent_state(self, *args: Any, **kwargs: Any) -> None:
        return None


def _zaya_cca(self: Any, run: Run, hidden_states: torch.Tensor, cache: Any = None,
              conv_mask: torch.Tensor | None = None) -> Any:  # fmt: skip
    """``ZayaCCAProjection.forward`` over the ranks: its own code on each piece, handed (as from a cache) the
    ``K`` query/key projections before the piece (zeros before the sequence, as its own padding) and the
    previous token's delayed value (before the sequence ``v_proj_delayed(0)``, as its own), which travel as
    the halo of :func:`xcp.recurrent.causal_conv` over ``[hidden | q, k projections | delayed value
    without its bias]`` (the bias added after, so that a zero halo gives ``v_proj_delayed(0)``)."""
    run.refuse_carried("a cache (use_cache=True)", None if _prompt(cache) else cache)
    if conv_mask is not None:  # applied here, before the projections the halo carries
        hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
    forward = type(self).forward
    taps = self.conv_kernel_size
    halo = max(taps, 1)  # the delayed value needs the previous token even without a convolution
    delayed, bias = self.v_proj_delayed.weight, self.v_proj_delayed.bias
    qk = torch.cat((self.q_proj(hidden_states), self.k_proj(hidden_states)), dim=-1)
    sizes = [hidden_states.shape[-1], qk.shape[-1], delayed.shape[0]]
    x = torch.cat((hidden_states, qk, torch.nn.functional.linear(hidden_states, delayed)), dim=-1)
    shapes: list[torch.Size] = []

    def conv(part: torch.Tensor) -> torch.Tensor:
        hidden, before_qk, before_v = part.split(sizes, dim=-1)
        value = before_v[:, halo - 1] if bias is None else before_v[:, halo - 1] + bias
        before = _Before(before_qk[:, halo - taps : halo].transpose(1, 2), value)
        outs = forward(self, hidden[:, halo:], before)
        shapes[:] = [o.shape[2:] for o in outs]
        out = torch.cat([o.flatten(2) for o in outs], dim=-1)
        return torch.cat((out.new_zeros((out.shape[0], halo, out.shape[-1])), out), dim=1)

    out = causal_conv(conv, x, halo + 1, **run.where)
    parts = out.split([shape.numel() for shape in shapes], dim=-1)
    if cache is not None:  # xcp's generate, the prompt's ring prefix: the whole sequence's states, on every rank
        if taps:
            cache.update_conv_state(qk.transpose(1, 2), self.layer_idx, conv_kernel_size=taps)
        last = last_inputs(self.v_proj_delayed(hidden_states), 1, **run.where)
        cache.update_recurrent_state(last[:, 0], self.layer_idx)
    return tuple(p.reshape(*p.shape[:2], *shape) for p, shape in zip(parts, shapes))


FAMILIES["ZayaCCAProjection"] = _zaya_cca

GENERATES: dict[str, Callable[..., Any]] = {
    "ZayaCCAProjection": _own_step,
    "RecurrentGemmaRecurrentBlock": _recurrent_gemma_step,
    "MiniMaxLightningAttention": _minimax_step,
    "RwkvSelfAttention": _own_step,
    "RwkvFeedForward": _own_step,
    "xLSTMLayer": _own_step,
}
"""The families whose states xcp's generate keeps whole on every rank (ZAYA and MiniMax in its cache, as
transformers' own cache layers keep them; RecurrentGemma in its blocks, as on one device; RWKV and xLSTM in
their model's own state objects, which xcp's cache keeps): their forward fills them from the prompt's ring
prefix; after it, ``step(module, cache, /, *args, **kwargs)`` runs their own forward on every rank."""

# --------------------------------------------------------------------------------------------------------
# xLSTM: the mLSTM's memory and normalizer under a running maximum


def _xlstm(self: Any, run: Run, x: torch.Tensor, state: Any = None) -> Any:
    """``xLSTMLayer.forward`` over the ranks: its own code, its backend's kernel (swapped in by
    :func:`_adapt_xlstm`) through state passing. Under the prompt's ring prefix of xcp's generate the model
    hands it the fresh zeros of its cache (the kernel's own start) and it returns the whole sequence's state
    ``(C, n, m)`` on every rank, as the layer does on one device."""
    prompt = _prompt(_generating())
    if not prompt:
        run.refuse_carried("state (use_cache=True)", state)
    with _running(replace(run, final=prompt)):
        return type(self).forward(self, x)


def _mlstm(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor,
           fgate: torch.Tensor, c_initial: Any = None, n_initial: Any = None, m_initial: Any = None,
           return_last_states: bool | None = None, mode: Any = None) -> Any:  # fmt: skip
    """``xLSTMBackend.forward`` (q, k ``[B, H, L, d_qk]``, v ``[B, H, L, d_v]``, gates ``[B, H, L]``) through
    state passing under a run: the memory ``C``, normalizer ``n`` and running maximum ``m`` packed as
    ``[B, H, d_qk d_v + d_qk + 1]`` (:class:`RunningMax`); a stretch decays them by ``exp(Σ logsigmoid(f))``.
    The kernel's outputs read ``m`` (its ``eps``), so the state entering a piece carries the maximum one
    device would have there: the fold starts from the kernel's own start (``m`` 0) and sums from the identity
    (``m`` far below). A piece whose length the "train" mode's chunks do not divide (or the mode
    "train_with_padding", which returns no last state) runs the "inference" mode: the same chunkwise kernel,
    the remainder step by step. Returns the outputs and no final state (none is asked under a run)."""
    forward = type(self).forward
    run = _active.run
    if run is None:
        return forward(self, query, key, value, igate, fgate, c_initial, n_initial, m_initial, return_last_states, mode)
    given = next((s for s in (c_initial, n_initial, m_initial) if s is not None), None)
    run.refuse_carried("an initial mLSTM state", given)
    d_qk, d_v = query.shape[-1], value.shape[-1]

    def kernel(q, k, v, i, f, initial_state=None, output_final_state=False):
        c = n = m = None
        if initial_state is not None:
            c = initial_state[..., : d_qk * d_v].unflatten(-1, (d_qk, d_v))
            n, m = initial_state[..., d_qk * d_v : -1], initial_state[..., -1:]
        how = mode or self.config.mode
        if how != "inference" and (how != "train" or q.shape[2] % self.config.chunk_size):
            how = "inference"  # the same kernels for any length, with the last states
        h, (c, n, m) = forward(self, q, k, v, i, f, c, n, m, return_last_states=True, mode=how)
        return h, torch.cat((c.flatten(-2).to(n.dtype), n, m.to(n.dtype)), dim=-1)

    def log_decay(q, k, v, i, f):
        return torch.nn.functional.logsigmoid(f).sum(dim=-1, keepdim=True)

    def identity(q, k, v, i, f):
        zeros = q.new_zeros((*q.shape[:2], d_qk * d_v + d_qk))
        return torch.cat((zeros, zeros.new_full((*q.shape[:2], 1), -1e30)), dim=-1)

    out, final = state_passing(
        kernel, query, key, value, igate, fgate, transition=RunningMax(log_decay, identity), **run.where,
        seq_dim=2, output_final_state=run.final,
    )  # fmt: skip
    if final is None:
        return out, None
    c, n, m = final.split([d_qk * d_v, d_qk, 1], dim=-1)
    return out, (c.unflatten(-1, (d_qk, d_v)), n, m)


def _adapt_xlstm(module: torch.nn.Module) -> None:
    _adapt(module)
    backend = module.mlstm_backend
    backend.forward = types.MethodType(_mlstm, backend)  # type: ignore[union-attr]


def _xlstm_model(self: Any, input_ids: Any = None, inputs_embeds: Any = None, cache: Any = None,
                 use_cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
    """``xLSTMModel.forward``; under xcp's generate (handed xcp's cache) over an ``xLSTMCache`` of its own that
    xcp's cache keeps: a fresh one for the prompt's ring prefix (its layers fill it with the whole sequence's
    states), the same one after it; the tokens counted, and xcp's cache handed back as the model's cache.
    generate hands the whole prompt to the first step (it finds what a cache holds through the attention mask,
    which xLSTM takes none of): the model runs the tokens its cache has not seen. The
    ring prefix runs the shard at once (the model would run a shard longer than ``max_inference_chunksize``
    chunk by chunk, each from the state after the last, which state passing does not take: it collects the
    hidden states instead, whose branch runs whole)."""
    sharded = _generating()
    if sharded is None or type(cache).__name__ != "ShardedCache":  # (by keyword: its decorators add use_cache)
        return type(self).forward(self, input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache,
                                  use_cache=use_cache, **kwargs)  # fmt: skip
    tokens = input_ids if input_ids is not None else inputs_embeds
    seen = sharded.get_seq_length()
    if not sharded.ring and seen and tokens.shape[1] > seen:  # generate's first step: the whole prompt again
        tokens = tokens[:, seen:]  # (it slices by the mask, which xLSTM takes none of): the tokens not yet seen
        input_ids, inputs_embeds = (tokens, None) if input_ids is not None else (None, tokens)
    own = None if sharded.ring else sharded.kept.get("xlstm")
    if own is None:
        weight = self.embeddings.weight
        own = _modeling(self).xLSTMCache(self.config, tokens.shape[0], dtype=weight.dtype, device=weight.device)
    if sharded.ring and tokens.shape[1] > self.config.max_inference_chunksize:
        kwargs["output_hidden_states"] = True
    out = type(self).forward(self, input_ids=input_ids, inputs_embeds=inputs_embeds, cache=own, use_cache=True,
                             **kwargs)  # fmt: skip
    if sharded.ring:
        own.seqlen_offset += tokens.shape[1] * (current().world_size - 1)  # the whole prefix's count
    sharded.kept["xlstm"] = own
    _seen(sharded, tokens.shape[1])
    out.cache = sharded
    return out


def _adapt_model(forward: Callable[..., Any]) -> Callable[[torch.nn.Module], None]:
    """An adapter of a model class whose forward xcp's generate needs changed (``forward``, bound to the
    instance): its mixers adapted too, as its children are its adapter's."""

    def adapt(module: torch.nn.Module) -> None:
        for layer in module.modules():
            name = type(layer).__name__
            if name in FAMILIES:
                ADAPTERS.get(name, _adapt)(layer)
        module.forward = types.MethodType(forward, module)

    return adapt


FAMILIES["xLSTMLayer"] = _xlstm

ADAPTERS = {
    "RecurrentGemmaRecurrentBlock": _adapt_recurrent_gemma,
    "RwkvSelfAttention": _adapt_rwkv,
    "RwkvFeedForward": _adapt_rwkv,
    "xLSTMLayer": _adapt_xlstm,
}
"""Families whose adapter does more than bind the forward (pieces swapped into the mixer's children)."""


MODELS: dict[str, Callable[..., Any]] = {
    "MiniMaxModel": _minimax_model,
    "RwkvModel": _rwkv_model,
    "xLSTMModel": _xlstm_model,
}
"""Model classes whose forward xcp's generate needs changed: MiniMax's refuses any cache but its own, RWKV's and
xLSTM's keep their states in objects of their own (kept in xcp's cache)."""

for _name, _model_forward in MODELS.items():
    register_layer(_name, _adapt_model(_model_forward), name=f"recurrent (inline): {_name}")
for _name in FAMILIES:
    register_layer(_name, ADAPTERS.get(_name, _adapt), name=f"recurrent (inline): {_name}")
