"""transformers ``generate()`` over a KV cache sharded across the ranks (:func:`generate`).

How a call runs, on every rank of the group:

1. the prompt's longest prefix that the balance can split and that leaves at least one token (a multiple
   of ``required_multiple(P, balance)``, at most ``L - 1``) goes through the ring, each rank running the
   model on its shard (global positions) while every layer's :class:`ShardedCache` layer keeps that
   shard (``KVCache.prefill``);
2. ``model.generate`` then runs as on one device with the cache passed in: it finds the prefix cached and
   feeds the rest of the prompt as one chunk (``KVCache.append`` of T > 1 tokens, then
   ``KVCache.attention``), then one token per step, every rank running the whole model on the same tokens;
   only attention talks to the other ranks (one combine per layer and step);
3. what a layer's cache keeps is what the model hands attention after the layer's update (the attention
   function asks :meth:`ShardedCache.attention`, which finds the layer by the tensors its update returned),
   so models that transform keys and values after the cache, write another slot or read another layer's
   keys attend over what they would with transformers' own cache;
4. a recurrent layer (a ``linear_attention``, ``conv`` or ``hybrid`` layer type) keeps its conv and
   recurrent states whole on every rank (:class:`ShardedStates`): the ring prefix runs it through state
   passing, whose final state is the whole prefix's on every rank; a model with such layers then runs the
   rest of the prompt but its last token one token at a time (:func:`_one_by_one`), and every rank advances
   the states with the model's own kernels on the same tokens;
5. the token of each step is rank 0's choice, passed to every rank (:class:`RankZeroChooses`), so ranks
   never drift apart: neither by sampling each with its own random numbers, nor by a greedy tie that
   rounding breaks differently on two ranks.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, ... : every attention module with transformers'
``expand_kv``) hands the cache its compressed latents, not keys and values; the sharded cache keeps them so
and attends over them with the up-projection absorbed into the queries and outputs (:class:`Latent`).

This module imports transformers; :mod:`xcp.integrations.transformers` imports it only when generating.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import schedule
from ..comm import Communicator, resolve_group
from ..context import Context
from ..inference.cache import KVCache
from ..plugins import select_backend
from . import decoding
from .transformers_unchangeable import Unchangeable

try:  # transformers with linear-attention cache layers (5.x): recurrent layers keep their states whole
    from .transformers_states import ShardedStates
except ImportError:  # pragma: no cover - older transformers: no recurrent layer in the cache
    ShardedStates = None  # type: ignore[assignment,misc]

SAMPLING = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
"""The generation options that shape the sampling distribution (transformers' logits warpers), which
:class:`RankZeroChooses` applies itself before rank 0 draws."""

REFUSED = {
    "num_beams": "beam search reorders the cache, which the ranks' shards cannot follow",
    "num_return_sequences": "more sequences than prompts would repeat the sharded cache; repeat input_ids instead",
    "assistant_model": "assisted decoding crops the cache",
    "prompt_lookup_num_tokens": "assisted decoding crops the cache",
    "watermarking_config": "the watermark applies after the sampling that rank 0 does",
}
"""Options of generate that xcp does not serve, with the reason."""


# --------------------------------------------------------------------------------------------------------
# The cache


class Latent:
    """One multi-head latent attention module (``module``: transformers' MLA, which has ``expand_kv``) whose
    sharded cache holds the compressed latents instead of the keys and values.

    transformers caches such a module's latents (``cache.update(kv_nope, k_rot)``: ``kv_nope`` ``[B, 1, T,
    kv_lora_rank]`` after its norm, ``k_rot`` ``[B, 1, T, qk_rope_head_dim]`` after RoPE) and expands them
    into every head's keys ``[k_nope, k_rot]`` and values (``kv_b_proj``, no bias) at every step. xcp keeps
    the latents as one key head ``[kv_nope, k_rot]`` with the value head ``kv_nope`` (576 and 512 wide for
    DeepSeek-V3, where the expanded keys and values of a token are 128 heads x (192 + 128)) and attends over
    them with the up-projection absorbed: a head's query ``[q_nope W_uk, q_rot]`` against the latents gives
    the scores of ``[q_nope, q_rot]`` against its expanded keys, and ``out W_uv`` its output over the
    expanded values. The same attention in another order of the sums (to rounding), with no token's keys
    or values expanded. The ring prefill attends over the expanded keys and values, as in training.
    """

    def __init__(self, module: Any) -> None:
        self.module = module

    @staticmethod
    def of(model: Any) -> dict[int, Latent]:
        """``{layer_idx: Latent}`` for the MLA attention modules of ``model`` (None: no model, none)."""
        if model is None:
            return {}
        names = ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        return {
            m.layer_idx: Latent(m)
            for m in model.modules()
            if callable(getattr(m, "expand_kv", None))
            and all(hasattr(m, n) for n in names)
            and isinstance(getattr(m, "layer_idx", None), int)
        }

    def keys_values(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, None]:
        """What ``cache.update`` receives (``[B, 1, T, kv_lora_rank]``, ``[B, 1, T, qk_rope_head_dim]``) as
        xcp's one key head ``[kv_nope, k_rot]`` (``[B, T, 1, D]``); the value head ``kv_nope`` is its first
        ``kv_lora_rank`` channels, which the layer's cache reads from the keys (:attr:`values_in_keys`)."""
        m = self.module
        want = (m.kv_lora_rank, m.qk_rope_head_dim)
        if (
            kv_nope.dim() != 4
            or k_rot.dim() != 4
            or kv_nope.shape[1] != 1
            or (kv_nope.shape[-1], k_rot.shape[-1]) != want
        ):
            raise ValueError(
                f"{type(m).__name__} (layer {m.layer_idx}): expected its cache to receive the latents [B, 1, T, "
                f"{want[0]}] and [B, 1, T, {want[1]}] (multi-head latent attention, as transformers >= 5 caches "
                f"it); got {tuple(kv_nope.shape)} and {tuple(k_rot.shape)}"
            )
        return torch.cat([kv_nope.transpose(1, 2), k_rot.transpose(1, 2)], dim=-1), None

    @property
    def values_in_keys(self) -> int:
        """The value head dim, ``kv_lora_rank``: the latent ``kv_nope`` is the key's first channels and the
        value, stored once (``KVCache(values_in_keys=)``)."""
        return int(self.module.kv_lora_rank)

    def attention(
        self, kv: KVCache, q: torch.Tensor, causal: bool, scale: float | None, window: Any, sinks: Any, **variants: Any
    ) -> torch.Tensor:
        """The heads' attention of ``q`` ``[B, T, H, qk_nope + qk_rope]`` over the latents in ``kv``, ``[B, T, H,
        v_head_dim]``: the queries ``[q_nope W_uk, q_rot]`` over the latents, their output times ``W_uv``."""
        m = self.module
        nope = m.qk_nope_head_dim
        w = m.kv_b_proj.weight.view(-1, nope + m.v_head_dim, m.kv_lora_rank)  # [H, nope + v, rank]: W_uk, W_uv
        if w.shape[0] != q.shape[2]:
            raise ValueError(f"{type(m).__name__}: {q.shape[2]} query heads, but kv_b_proj expands {w.shape[0]}")
        scale = q.shape[-1] ** -0.5 if scale is None else scale  # q's own dim, not that of the latents
        absorbed = torch.cat([torch.einsum("bthn,hnr->bthr", q[..., :nope], w[:, :nope]), q[..., nope:]], dim=-1)
        out = kv.attention(absorbed, causal=causal, scale=scale, window=window, sinks=sinks, **variants)
        return torch.einsum("bthr,hvr->bthv", out, w[:, nope:])


_STEPS = itertools.count()


class _Step:
    """What one ``update`` of a layer returned (weakly: the cache never keeps the model's tensors alive) and
    the attention calls that followed it: ``calls[i]`` the (key, value) pair the i-th distinct call had,
    which sub-cache i of the layer keeps."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.order = next(_STEPS)  # which update came last
        self.tokens = key.shape[2]
        self.returned = (weakref.ref(key), weakref.ref(value))
        self.calls: list[tuple[weakref.ref, weakref.ref]] = []

    def returned_any(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        return self.returned[0]() is key or self.returned[1]() is value

    def call_of(self, key: torch.Tensor, value: torch.Tensor) -> int | None:
        """The index of an earlier call with these very tensors (a layer reading another's keys), or None."""
        return next((i for i, (k, v) in enumerate(self.calls) if k() is key and v() is value), None)


class ShardedLayer(Unchangeable, CacheLayerMixin):
    r"""One layer's transformers cache over :class:`xcp.KVCache`\ s: ``update`` returns the new keys and
    values as they came (so that the attention function sees keys as long as its queries), and the
    attention that follows keeps what it is handed (:meth:`ShardedCache.attention`): the keys and values
    the model gives attention, which are what ``update`` returned or derived from it per token (DiffLlama
    splits the values, JetMoE repeats both). Each distinct attention call after an update has a sub-cache
    of its own (DiffLlama calls attention twice with two halves of the values); an MLA layer's sub-cache
    keeps its latents (:class:`Latent`), as ``update`` received them."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, make: Callable[[], KVCache], sliding: bool, latent: Latent | None = None) -> None:
        CacheLayerMixin.__init__(self)  # by name: a hybrid layer's other base (ShardedStates) takes other arguments
        self.make = make
        self.kvs = [make()]
        self.is_sliding = sliding
        self.latent = latent  # an MLA layer: the cache holds its latents
        self.ring = False  # True while the prompt's shard goes through the ring
        self.step: _Step | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # an MLA layer's latents, until attention

    @property
    def kv(self) -> KVCache:
        """The first sub-cache (the only one but for models that attend more than once per update)."""
        return self.kvs[0]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.step = _Step(key_states, value_states)
        if self.latent is not None:
            self.pending = self.latent.keys_values(key_states, value_states)  # type: ignore[assignment]
        return key_states, value_states

    def keep(self, index: int, key: torch.Tensor, value: torch.Tensor, who: str) -> KVCache:
        """Sub-cache ``index`` after keeping the tokens of this step in it: ``key``/``value`` ``[B, H_kv, T, D]``
        as attention had them (an MLA layer: the latents ``update`` received); the prompt's shard with the
        ring (``KVCache.prefill``), else the step's tokens (``KVCache.append``)."""
        if index == len(self.kvs) and self.ring:
            self.kvs.append(self.make())
        if index >= len(self.kvs):
            raise ValueError(
                f"{who}: attention call {index + 1} after one cache update, where the prompt had {len(self.kvs)}: "
                "the model attends differently while generating, which xcp's sharded cache cannot follow"
            )
        kv = self.kvs[index]
        if self.latent is not None:
            assert self.pending is not None
            k, v = self.pending
            self.pending = None
        else:
            k, v = key.transpose(1, 2), value.transpose(1, 2)  # transformers' [B, H, T, D] -> xcp's
        if self.ring:
            kv.prefill(k, v)
        else:
            kv.append(k, v)
        return kv

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.kv.seq_len

    def get_max_length(self) -> int:
        return -1

    def __deepcopy__(self, memo: dict) -> ShardedLayer:
        """A new, empty layer like this one (Dory adds cache layers by copying empty ones); a layer that
        holds tokens cannot be copied: its shards live on the ranks of its group."""
        if self.step is not None or any(kv.seq_len for kv in self.kvs):
            self._cannot("copying a layer that holds tokens")
        copied = ShardedLayer(self.make, self.is_sliding, self.latent)
        copied.ring = self.ring
        return copied


if ShardedStates is not None:

    class ShardedHybrid(ShardedLayer, ShardedStates):  # type: ignore[misc]  # device: None until initialized
        """A layer with a recurrent mixer beside attention (transformers' ``hybrid`` layer type: Falcon-H1,
        Zamba2's hybrid layers): the sharded keys and values of :class:`ShardedLayer` and the whole states of
        :class:`ShardedStates`; its length is that of its keys and values."""

        def __init__(
            self,
            make: Callable[[], KVCache],
            sliding: bool,
            latent: Latent | None,
            group: Any,
            balance: str,
            states: int,
        ) -> None:
            ShardedStates.__init__(self, group, balance, states)
            ShardedLayer.__init__(self, make, sliding, latent)

        def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
            """The attention's (keys and values, positional) or the states' (keywords)."""
            if args:
                ShardedLayer.lazy_initialization(self, *args)
            else:
                ShardedStates.lazy_initialization(self, **kwargs)

        def advance(self, tokens: int) -> None:
            """The keys and values count this layer's tokens."""

        def __deepcopy__(self, memo: dict) -> ShardedHybrid:
            if self.step is not None or any(kv.seq_len for kv in self.kvs) or any(self.has_previous_state.values()):
                self._cannot("copying a layer that holds tokens")
            return ShardedHybrid(
                self.make, self.is_sliding, self.latent, self.group, self.balance, self.number_of_states
            )


STATES = ("linear_attention", "conv")
"""transformers' layer types of a recurrent layer alone: its slot keeps states (:class:`ShardedStates`)."""

HYBRID = ("hybrid", "hybrid_sliding")
"""transformers' layer types of a recurrent mixer beside attention (:class:`ShardedHybrid`)."""

RECURRENT_ONLY = ("rwkv", "xlstm")
"""transformers' model types whose every layer is recurrent and whose config names no layer types: every slot
of their cache counts the tokens seen (:class:`ShardedStates`); the states live in the model's own objects
(:attr:`ShardedCache.kept`)."""


class ShardedCache(Cache):
    r"""A transformers ``Cache`` holding :class:`ShardedLayer`\ s, one per layer of ``config``; its
    :meth:`attention` is what the attention function asks for a module's attention.

    :param model: the model whose cache it is (optional): its multi-head latent attention modules
        (:meth:`Latent.of`) make their layers keep latents.

    ``kept`` holds the state objects a family's model keeps outside cache layers (RWKV's ``state`` list,
    xLSTM's ``xLSTMCache``: :mod:`xcp.integrations.transformers_inline`), whole on every rank.
    """

    def __init__(self, config: Any, group: Any, balance: str, capacity: int | None = None, model: Any = None) -> None:
        text = config.get_text_config(decoder=True)
        alone = "linear_attention" if getattr(text, "model_type", None) in RECURRENT_ONLY else None
        types = getattr(text, "layer_types", None) or (
            [alone or ("sliding_attention" if getattr(text, "sliding_window", None) else "full_attention")]
            * text.num_hidden_layers
        )
        latents = Latent.of(model)
        states = int(getattr(text, "number_of_conv_states", 1) or 1)
        self.sharded: list[Any] = []
        for i, t in enumerate(types):
            latent = latents.get(i)
            width = None if latent is None else latent.values_in_keys
            make = functools.partial(KVCache, group, balance, capacity, values_in_keys=width)
            if ShardedStates is not None and t in STATES:
                self.sharded.append(ShardedStates(group, balance, states))
            elif ShardedStates is not None and t in HYBRID:
                self.sharded.append(ShardedHybrid(make, t == "hybrid_sliding", latent, group, balance, states))
            else:
                self.sharded.append(ShardedLayer(make, t == "sliding_attention", latent))
        super().__init__(layers=list(self.sharded))
        self.ring = False
        self.kept: dict[str, Any] = {}  # a family's state object its model keeps outside cache layers (RWKV's list)
        # a slot past the config's layers (HRM writes layer_idx + an offset per cycle): transformers' Cache
        # appends layers made by this until the slot exists
        more = functools.partial(self._more, functools.partial(KVCache, group, balance, capacity))
        self.layer_class_to_replicate = more  # type: ignore[assignment]  # called with no argument, as a class

    def _more(self, make: Callable[[], KVCache]) -> ShardedLayer:
        layer = ShardedLayer(make, False)
        layer.ring = self.ring
        return layer

    def set_ring(self, on: bool) -> None:
        """Whether the next forward is the prompt's ring prefill (True) or a step over the cache (False)."""
        self.ring = on
        for layer in self.layers:
            cast(ShardedLayer, layer).ring = on

    @property
    def has_states(self) -> bool:
        """Whether a layer keeps a recurrent mixer's states."""
        return ShardedStates is not None and any(isinstance(layer, ShardedStates) for layer in self.layers)

    def advance(self, layer_idx: int, tokens: int) -> None:
        """The recurrent mixer of layer ``layer_idx`` ran over ``tokens`` more tokens of the sequence (the
        prepared mixer tells, :mod:`xcp.integrations.transformers_recurrent`): the count ``get_seq_length``
        gives of a layer without keys and values."""
        layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
        if ShardedStates is None or not isinstance(layer, ShardedStates):
            raise ValueError(
                f"layer_idx: expected the slot of a recurrent layer in xcp's generate cache (layer types "
                f"{STATES + HYBRID}); got {layer_idx}, a {type(layer).__name__}"
            )
        layer.advance(tokens)

    def _layer_of(self, module: Any, key: torch.Tensor, value: torch.Tensor, who: str) -> ShardedLayer:
        """The layer whose update returned ``key`` or ``value`` (a layer's own slot, another's that it
        shares, or the slot the model chose, e.g. ``layer_idx + offset``); else the layer updated last when
        attention got that update's tokens transformed (the same number of them)."""
        own = getattr(module, "layer_idx", None)
        if isinstance(own, int) and 0 <= own < len(self.layers):  # the common case first: the module's own slot
            mine = self.layers[own]
            if isinstance(mine, ShardedLayer) and mine.latent is None and mine.step is not None:
                if mine.step.returned_any(key, value):
                    return mine
        layers = [layer for layer in self.layers if isinstance(layer, ShardedLayer)]  # not a recurrent layer's states
        for layer in layers:
            if layer.latent is not None and layer.latent.module is module:  # its update had the latents
                return layer
        updated = [layer for layer in layers if layer.step is not None]
        for layer in updated:
            if layer.step is not None and layer.step.returned_any(key, value):
                return layer
        last = max(updated, key=lambda layer: cast(_Step, layer.step).order, default=None)
        if last is not None and last.step is not None and last.latent is None:
            if last.step.tokens == key.shape[2] == value.shape[2]:
                return last
        raise ValueError(
            f"{who}: the keys and values handed to attention come from no update of xcp's sharded cache in this "
            "step (the model attends over keys it did not give the cache), so generate() cannot serve this model"
        )

    def attention(
        self,
        module: Any,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        causal: bool,
        scale: float | None,
        window: Any,
        sinks: Any,
        who: str,
        **variants: Any,
    ) -> torch.Tensor | None:
        """The :data:`xcp.integrations.decoding.Decoder` of this cache: ``module``'s attention over the sharded
        cache, or None during the ring prefill (the attention function runs the ring then), after keeping
        this step's keys and values in the layer's sub-cache of this call; ``variants``: ``softcap=`` and
        ``chunk=`` of :meth:`xcp.KVCache.attention`, where the layer has them."""
        layer = self._layer_of(module, key, value, who)
        step = layer.step
        assert step is not None
        index = step.call_of(key, value)
        if index is None:  # a new call: keep what it was handed
            index = len(step.calls)
            kv = layer.keep(index, key, value, who)
            step.calls.append((weakref.ref(key), weakref.ref(value)))
        else:  # the same tensors again: attend over what the earlier call kept
            kv = layer.kvs[index]
        if layer.ring:
            return None
        if layer.latent is not None:
            return layer.latent.attention(kv, q, causal, scale, window, sinks, **variants)
        return kv.attention(q, causal=causal, scale=scale, window=window, sinks=sinks, **variants)


# --------------------------------------------------------------------------------------------------------
# The choice of each token


class RankZeroChooses(LogitsProcessor):
    """Rank 0 picks each step's token (argmax, or a draw from its default generator after the sampling
    warpers); every rank receives it and hands generate scores where only that token is finite, so that
    generate's own argmax takes it. The scores generate would have recorded are kept in ``scores``."""

    def __init__(self, comm: Communicator, backend: Any, warpers: LogitsProcessorList | None) -> None:
        self.comm: Any = comm  # with all_gather, as the caches' combine needs (an optional member of the protocol)
        self.backend, self.warpers = backend, warpers
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        final = scores if self.warpers is None else self.warpers(input_ids, scores)
        self.scores.append(final)
        if self.warpers is None:
            mine = final.argmax(dim=-1)
        elif self.comm.rank() == 0:  # the only rank that draws: one device's stream of random numbers
            mine = torch.multinomial(torch.nn.functional.softmax(final, dim=-1), num_samples=1).squeeze(1)
        else:
            mine = torch.zeros(final.shape[0], dtype=torch.long, device=final.device)
        if self.comm.size() > 1:
            mine = self._rank_zeros(mine)
        out = torch.full_like(scores, float("-inf"))
        return cast(torch.FloatTensor, out.scatter_(1, mine[:, None], 0.0))

    def _rank_zeros(self, mine: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``mine``, by one all-gather (which the KV caches' combine needed of the group already)."""
        every = mine.new_empty((self.comm.size(), *mine.shape))
        self.comm.all_gather(mine.contiguous(), every, "token", self.backend).wait()
        return every[0]


def _warpers(model: Any, config: GenerationConfig, prompt: torch.Tensor) -> LogitsProcessorList | None:
    """transformers' sampling warpers of ``config`` (None for greedy decoding)."""
    if not config.do_sample:
        return None
    only = GenerationConfig(do_sample=True, **{name: getattr(config, name, None) for name in SAMPLING})
    return model._get_logits_processor(
        generation_config=only,
        input_ids_seq_length=prompt.shape[1],
        encoder_input_ids=prompt,
        logits_processor=LogitsProcessorList(),
        device=prompt.device,
        model_kwargs={},
    )


def _greedy_config(config: GenerationConfig) -> GenerationConfig:
    """``config`` for generate itself: greedy (the choice is :class:`RankZeroChooses`'), sampling options unset."""
    config.do_sample = False
    for name in SAMPLING:
        if hasattr(config, name):
            setattr(config, name, None)
    return config


# --------------------------------------------------------------------------------------------------------
# generate


def _check(input_ids: Any, max_new_tokens: Any, kwargs: dict[str, Any]) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        what = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids: expected a 2-D integer tensor [batch, prompt length]; got {what}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids: expected at least one prompt of at least one token; got {tuple(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive integer; got {max_new_tokens!r}")
    ulysses = kwargs.pop("ulysses", 1)  # a context's keyword, not the model's: named here, not by transformers
    if isinstance(ulysses, bool) or ulysses != 1:
        raise ValueError(
            f"ulysses: expected 1 under generate (the sharded KV cache keeps the ring's layout, every head of a "
            f"token on the rank that holds it; the prompt's prefix goes through the ring alone); got {ulysses!r}"
        )
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: expected None (xcp makes the sharded cache); got {type(kwargs[name]).__name__}")
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(input_ids.shape):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} (that of input_ids); got {got}")
        if not bool(mask.all()):
            raise ValueError(
                f"attention_mask: expected no padding (prompts of equal length); got {int((mask == 0).sum())} padded "
                "token(s), a ragged batch, which the sharded cache does not serve: generate each length apart"
            )


def _refuse(config: GenerationConfig, kwargs: dict[str, Any]) -> None:
    for name, why in REFUSED.items():
        value = kwargs.get(name, getattr(config, name, None))
        if value is not None and value is not False and value != 1:
            raise ValueError(f"{name}: not supported by xcp's generate ({why}); got {value!r}")
    if config.use_cache is False:
        raise ValueError("use_cache: expected True (generation runs over the sharded KV cache); got False")


def _check_model(model: Any) -> None:
    """Refuse what the sharded cache cannot hold: cross-attention layers (Mllama), whose cache keeps the
    image's keys and values whole and which the model reads from the cache layer itself."""
    crossing = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("CrossAttention")})
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "cross_attention_layers", None):  # the model reads those layers' caches, built or not
        crossing.append(f"config.cross_attention_layers={list(text.cross_attention_layers)}")
    if crossing:
        raise ValueError(
            f"model: cross-attention layers ({', '.join(crossing)}) cache the keys and values of another input "
            "(an image, an encoder), which xcp's sharded cache does not hold; generate() serves self-attention only"
        )


def _cache_name(model: Any) -> str:
    """The keyword the model takes its cache by (``cache`` since transformers 5.x, ``past_key_values`` before;
    ``cache`` where the forward names neither, as RWKV's, whose generate takes ``cache``)."""
    names = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in names and "cache" not in names else "cache"


def _decoder_of(model: Any) -> Any:
    """The model without its LM head, which the ring prefix runs (its logits are never read): the base model, or
    where ``base_model_prefix`` names no attribute (Llama-4's ``language_model``: ``base_model`` is the model
    itself) its ``model``."""
    base = model.base_model
    inner = getattr(model, "model", None)
    return inner if base is model and isinstance(inner, torch.nn.Module) else base


def _one_by_one(model: Any, cache: ShardedCache, name: str, input_ids: torch.Tensor, start: int) -> None:
    """The prompt's tokens from ``start`` to its last but one, one at a time, through the model on every rank
    (what generate would run as one chunk): a recurrent mixer goes on from its cached state one token at a
    time (Mamba's selective scan takes no initial state, so transformers' Mamba mixers ignore the state over
    a chunk), and generate then runs the prompt's last token, as it runs every new one."""
    decoder = _decoder_of(model)
    with torch.no_grad():
        for t in range(start, input_ids.shape[1] - 1):
            position = torch.full((input_ids.shape[0], 1), t, dtype=torch.long, device=input_ids.device)
            decoder(input_ids=input_ids[:, t : t + 1], position_ids=position, use_cache=True, **{name: cache})


def generate(model: Any, input_ids: torch.Tensor, group: Any, max_new_tokens: int, balance: str, options: dict) -> Any:
    """:func:`xcp.integrations.transformers.generate`, ``options`` its ``**generate_kwargs`` (not mutated)."""
    generate_kwargs = dict(options)
    _check(input_ids, max_new_tokens, generate_kwargs)
    _check_model(model)
    ctx = Context(group, balance)
    given = generate_kwargs.pop("generation_config", None)
    config, model_kwargs = model._prepare_generation_config(given, max_new_tokens=max_new_tokens, **generate_kwargs)
    _refuse(config, model_kwargs)
    comm = resolve_group(group)
    chooser = RankZeroChooses(comm, select_backend(None, input_ids.device.type), _warpers(model, config, input_ids))
    processors = LogitsProcessorList([*(model_kwargs.pop("logits_processor", None) or []), chooser])

    unit = schedule.required_multiple(ctx.world_size, ctx.balance)
    ring = (input_ids.shape[1] - 1) // unit * unit  # the prompt's longest prefix the balance splits, less a token
    cache = ShardedCache(model.config, group, ctx.balance, capacity=input_ids.shape[1] + max_new_tokens, model=model)
    name = _cache_name(model)
    with ctx, decoding.using(cache.attention):
        if ring:
            positions = torch.arange(ring, device=input_ids.device).expand(input_ids.shape[0], ring)
            cache.set_ring(True)
            try:
                with torch.no_grad():
                    _decoder_of(model)(
                        input_ids=ctx.shard(input_ids[:, :ring]),
                        position_ids=ctx.shard(positions),
                        use_cache=True,
                        **{name: cache},
                    )
            finally:
                cache.set_ring(False)
            if cache.has_states:
                _one_by_one(model, cache, name, input_ids, ring)
        out = model.generate(
            input_ids,
            generation_config=_greedy_config(config),
            logits_processor=processors,
            **{name: cache},
            **model_kwargs,
        )
    if getattr(out, "scores", None) is not None:
        out.scores = tuple(chooser.scores)
    return out
