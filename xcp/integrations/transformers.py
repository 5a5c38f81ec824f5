"""Hugging Face transformers, context parallel: ``attn_implementation="xcp"``.

::

    from xcp.integrations.transformers import prepare, reduce_gradients, register, shard_batch
    register()                                        # once per process: the name "xcp"
    model = prepare(AutoModelForCausalLM.from_config(cfg, attn_implementation="xcp"))
    with xcp.context(group):                          # this rank's group and balance
        batch = shard_batch(input_ids, labels=input_ids)
        loss = model(**batch.model_kwargs()).loss     # this rank's share of the global mean loss
        loss.backward()
    reduce_gradients(model.parameters())              # SUM over the ranks of the sequence

:func:`prepare` makes every layer context-parallel or refuses the model naming the layer xcp cannot make
right (:mod:`xcp.integrations.transformers_prepare`, with the registry of adapters and refusals); xcp's
attention and mask functions refuse a model that was not prepared.

Every rank runs the whole model on its shard of the sequence; only attention talks to the other ranks
(:func:`xcp.attention` with the current :func:`xcp.context`). What else must be done on the whole sequence
is done by :func:`shard_batch`: the labels shifted before sharding, the global positions, the global
count of the tokens in the loss. The ranks' gradients are partial sums: add them up (``reduce_gradients``,
or the note there for DDP).

What xcp cannot do raises an error naming the model's attention class and the option: padding masks and
other 4-D masks, attention dropout in training, output_attentions, custom mask functions, a transformers
KV cache that makes keys longer than queries. Logit soft-capping (Gemma-2's ``softcap=``) and attention
chunks (Llama-4's chunked layers) go to :func:`xcp.attention` as ``softcap=`` and ``chunk=``
(:mod:`xcp.integrations.transformers_variants`).

Generation: :func:`generate` (``generate(model, input_ids, group=g, max_new_tokens=16)``) runs
``model.generate`` over a KV cache sharded across the ranks (:mod:`xcp.integrations.transformers_generate`;
docs/integrations.md, "Generation").

Under ``torch.compile`` the attention function traces without a graph break (``fullgraph=True`` works)
on a world of one and on torch.distributed groups; LocalWorld groups stay eager. What cannot be read on
the host inside a graph is checked differently there (:func:`_documents_traced`, :func:`_mask_traced`;
docs/integrations.md, "torch.compile").

transformers is imported when first needed, never by the core of xcp.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .. import schedule
from ..checks import check_dim
from ..context import Context, current
from ..documents import check_cu_seqlens
from ..padding import pad_to_balance, padded_length
from . import (
    decoding,
    transformers_inline,  # noqa: F401  (registers the adapters of mixers with their recurrence inline)
    transformers_recurrent,  # noqa: F401  (registers the recurrent layers' adapters)
)
from .transformers_prepare import (
    add_forward_check,
    config_prepared,
    is_prepared,
    prepare,
    refuse_layer,
    register_layer,
    unprepared,
    unregister_layer,
)
from .transformers_serving import generate_batch, generate_ragged, left_padding
from .transformers_variants import CHUNK_PART, check_chunk_part, variants

__all__ = [
    "attention_forward",
    "generate",
    "generate_batch",
    "is_prepared",
    "mask_forward",
    "prepare",
    "reduce_gradients",
    "refuse_layer",
    "register",
    "register_layer",
    "shard_batch",
    "unregister_layer",
]

DEFAULT_NAME = "xcp"
IGNORE_INDEX = -100
_PADDED_ROWS = "_xcp_padded_rows"
"""The attribute that marks the sharded position_ids of a batch > 1 padded at the end of every row
(``shard_batch(..., pad=True)``): the attention function refuses such a batch in a non-causal layer."""

_INSTALL = "pip install 'xcp[transformers]'"


def _transformers() -> Any:
    """The transformers package, or an ImportError that says how to get it."""
    try:
        import transformers
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401 - needed by register()
    except Exception as exc:  # ImportError, or a broken install failing inside its own imports
        raise ImportError(
            f"xcp.integrations.transformers needs transformers, which is not importable: {exc} ({_INSTALL})"
        ) from exc
    return transformers


def register(name: str = DEFAULT_NAME) -> str:
    """Register xcp's attention function and its mask function under ``name``; return ``name``.

    Afterwards ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) runs attention across the ranks of the current
    :func:`xcp.context`. The mask function is needed too: without an entry of the same name in
    ``AttentionMaskInterface`` transformers drops a padding ``attention_mask`` silently; with it, a padding
    mask raises here instead.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string; got {name!r}")
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)
    for model, (label, table) in _OWN_TABLES.items():
        _refuse_in_table(model, label, table, name)
    return name


_OWN_TABLES = {
    "falcon": ("Falcon", "FALCON_ATTENTION_CLASSES"),
    "gpt_neo": ("GPT-Neo", "GPT_NEO_ATTENTION_CLASSES"),
    "git": ("GIT", "GIT_SELF_ATTENTION_CLASSES"),
}
"""Models that pick their attention class from a table of their own keyed by ``attn_implementation``
(none of those classes calls transformers' attention interface): without an entry for xcp's name they
fail while being built with a bare ``KeyError``; :func:`register` gives them one that says why."""


def _refuse_in_table(model: str, label: str, table: str, name: str) -> None:
    import importlib

    try:
        classes = getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), table)
    except (ImportError, AttributeError):  # another transformers version: nothing to do
        return
    if name in classes:
        return

    class RefusedAttention(torch.nn.Module):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            raise ValueError(
                f"attn_implementation={name!r}: {label} ({type(config).__name__}) takes its attention class from "
                f"its own table ({table}), and none of them calls transformers' attention interface, so xcp's "
                "attention would never run and each rank would attend over its own shard alone; context "
                f"parallelism is not supported for {label} (build it with attn_implementation='eager' or 'sdpa')"
            )

    RefusedAttention.__qualname__ = RefusedAttention.__name__ = f"{label.replace('-', '')}RefusedByXcp"
    classes[name] = RefusedAttention


# --------------------------------------------------------------------------------------------------------
# The attention function


def _who(module: Any) -> str:
    config = getattr(module, "config", None)
    owner = f" of a {type(config).__name__} model" if config is not None else ""
    return f"xcp attention ({type(module).__name__}{owner})"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over xcp: q ``[B, H, S_local, D]``, k ``[B, Hkv, S_local, D]``, v
    ``[B, Hkv, S_local, Dv]`` of this rank's tokens; returns ``([B, S_local, H, Dv], None)``. Dv may differ
    from D (multi-head latent attention: DeepSeek-V3's 192 and 128, v unpadded as transformers passes it).

    - causal from ``is_causal=`` when given, else ``module.is_causal`` (and ``config.is_causal``);
    - ``scaling`` is xcp's ``scale``;
    - ``sliding_window=W``: transformers lets query i see keys ``i - W < j <= i`` (its mask
      ``kv_idx > q_idx - sliding_window``, and flash's ``window_size=(W - 1, W - 1)``): W keys *counting
      the query itself*, which is xcp's ``window=(W - 1, 0)``; a model that builds a window mask without
      passing ``sliding_window=`` hands over :func:`mask_forward`'s :class:`WindowMask` as ``attention_mask``;
    - packed documents: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (the GLOBAL boundaries, as
      :func:`shard_batch` gives them) are xcp's ``cu_seqlens``; on one rank, position_ids that restart
      (transformers' own rule: a step other than +1 starts a document) are turned into them too;
    - attention sinks: ``module.sinks`` (GPT-OSS), else ``s_aux=``;
    - ``softcap=`` (Gemma-2) and the chunks of Llama-4's chunked layers (from the config): xcp's ``softcap`` and
      ``chunk`` (:func:`xcp.integrations.transformers_variants.variants`).
    """
    who = _who(module)
    if not is_prepared(module):
        raise ValueError(unprepared(who))
    if isinstance(attention_mask, WindowMask):  # the window of the mask, which some models do not pass
        if sliding_window is not None and int(sliding_window) != attention_mask.window:
            raise ValueError(
                f"{who}: sliding_window={sliding_window} disagrees with the window of the model's mask "
                f"({attention_mask.window})"
            )
        sliding_window, attention_mask = attention_mask.window, None
    if attention_mask is not None:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"{who}: got an attention_mask ({shape}); xcp computes causal/full attention over the sharded "
            "sequence and takes no mask tensor. Padding inside a context-parallel sequence is not supported: "
            "pack the documents into one sequence instead (shard_batch(..., cu_seqlens=...) or position_ids that "
            "restart at 0) and leave attention_mask out"
        )
    if dropout and module.training:
        raise ValueError(
            f"{who}: attention dropout {dropout} in training is not supported; set config.attention_dropout = 0.0"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{who}: position_bias is not supported by xcp (the config or caller sets position_bias=)")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{who}: output_attentions=True is not supported (xcp never forms the attention weights)")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{who}: keys ({key.shape[2]}) longer than queries ({query.shape[2]}): a transformers KV cache is not "
            "supported; generate with xcp.integrations.transformers.generate (a KV cache sharded across the ranks), "
            "or run the whole sequence with use_cache=False"
        )

    compiling = torch.compiler.is_compiling()
    ctx = current()
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        config = getattr(module, "config", None)
        is_causal = bool(getattr(module, "is_causal", True)) and bool(getattr(config, "is_causal", True))
    if not is_causal and getattr(kwargs.get("position_ids"), _PADDED_ROWS, None):
        raise ValueError(
            f"{who}: the batch's rows were padded at their ends (shard_batch(..., pad=True) with batch > 1), "
            "which is exact only under causal attention; this layer is bidirectional, so its real tokens would "
            "see the padding. Pack the rows into one of batch 1 as documents (input_ids.reshape(1, -1) with "
            "shard_batch(..., cu_seqlens=[0, S, 2S, ...], pad=True)), where the padding is a document of its own"
        )
    window = None
    if sliding_window is not None:
        if not is_causal:
            raise ValueError(
                f"{who}: a bidirectional sliding window (sliding_window={sliding_window}) is not supported "
                "(transformers' masks and flash disagree on its width)"
            )
        window = (int(sliding_window) - 1, 0)  # W keys, the query's own included: i - W < j <= i
    sinks = getattr(module, "sinks", None)
    if sinks is None:
        sinks = kwargs.get("s_aux")
    variant = variants(module, kwargs)  # softcap=, chunk=: only where the layer has them
    decoder = decoding.current()
    if decoder is not None and compiling:
        raise ValueError(f"{who}: generate() over xcp's sharded KV cache runs the model eagerly; got a compiled model")
    if decoder is not None:  # xt.generate: a step over the sharded KV cache (None: the prompt's ring)
        out = decoder(module, query.transpose(1, 2), key, value, is_causal, scaling, window, sinks, who, **variant)
        if out is not None:
            return out, None
    cu_seqlens = _documents_traced(ctx, query, kwargs, who) if compiling else _documents(ctx, query, kwargs, who)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out = ctx.attention(
        q, k, v, causal=is_causal, scale=scaling, window=window, sinks=sinks, cu_seqlens=cu_seqlens, **variant
    )
    return out, None


_NOT_XCP = ("eager", "sdpa", "flash", "flex", "paged")
"""How transformers' own attention implementations are named (``eager``, ``sdpa``, ``flash_attention_2``,
``flex_attention``, ``paged|sdpa``, ...); a name registered by anyone else may wrap xcp's function."""


@add_forward_check
def _attention_is_xcp(model: torch.nn.Module) -> None:
    """Before a prepared model's forward: under a context of more than one rank its attention must be xcp's
    (a model switched or built over to another, e.g. by ``from_config(config, attn_implementation="eager")``
    on the config object it shares, would attend over each rank's shard alone, silently)."""
    if torch.compiler.is_compiling() or decoding.current() is not None:
        return
    ctx = current()
    if ctx.world_size == 1:
        return
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None or impl.startswith(_NOT_XCP) or "/" in impl:  # transformers' own, or a hub kernel's
        raise ValueError(
            f"{type(model).__name__}: attn_implementation {impl!r} under an xcp.context of {ctx.world_size} ranks: "
            "each rank would attend over its own shard alone; set it back with model.set_attn_implementation('xcp') "
            "(transformers' from_config changes the config object it is given: build a reference model from a copy, "
            "from_config(copy.deepcopy(config), ...))"
        )


# --------------------------------------------------------------------------------------------------------
# Documents and positions


_checked = threading.local()
"""Per thread, the last position_ids (and cu_seq_lens) checked: every layer of a forward passes the same
tensors, so the check (a host read) runs once per forward, not once per layer."""


def _global_index(ctx: Context, local_len: int, device: torch.device) -> torch.Tensor:
    """The global positions of this rank's tokens, in local order (the shard of arange(S))."""
    world = ctx.world_size
    return ctx.shard(torch.arange(local_len * world, device=device).unsqueeze(0))[0]


def _as_cu(x: Any, name: str, who: str) -> tuple[int, ...]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.is_floating_point():
            raise ValueError(f"{who}: {name}: expected a 1-D integer tensor; got {x.dtype} {tuple(x.shape)}")
        return tuple(int(i) for i in x.tolist())
    return tuple(int(i) for i in x)


def _restarting(cu: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Positions that restart at 0 at every boundary of ``cu`` (the whole sequence)."""
    if torch.compiler.is_compiling():  # no shape may depend on data in a graph: each token's document found
        bounds = torch.tensor(cu, device=device)
        index = torch.arange(cu[-1], device=device)
        return index - bounds[torch.searchsorted(bounds[1:], index, right=True)]
    lengths = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], device=device)
    starts = torch.tensor(cu[:-1], device=device).repeat_interleave(lengths)
    return torch.arange(cu[-1], device=device) - starts


def _documents(ctx: Context, query: torch.Tensor, kwargs: dict, who: str) -> tuple[int, ...] | None:
    """The global document boundaries for xcp (None: one document per row), after checking that the
    position_ids passed to the model are the global ones of this rank's tokens."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() != 2:
        pos = None  # multi-axis positions (mrope): nothing to check here
    key = (
        ctx.world_size,
        ctx.rank,
        ctx.balance,
        ctx.ulysses,
        query.shape[2],
        None if pos is None else (id(pos), pos._version),
        None if cu_q is None else id(cu_q),
        None if cu_k is None else id(cu_k),
    )
    last = getattr(_checked, "last", None)
    if last is not None and last[0] == key and all(r() is not None for r in last[1]):
        return last[2]
    cu = _documents_uncached(ctx, query, pos, cu_q, cu_k, who)
    refs = tuple(weakref.ref(t) for t in (pos, cu_q, cu_k) if isinstance(t, torch.Tensor))
    _checked.last = (key, refs, cu)
    return cu


def _boundaries(ctx: Context, local: int, cu_q: Any, cu_k: Any, who: str) -> tuple[int, ...] | None:
    """The boundaries of cu_seq_lens_q/k, checked against each other and the global length."""
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError(f"{who}: pass both cu_seq_lens_q and cu_seq_lens_k (equal, for self-attention)")
    world = ctx.world_size
    seq_len = local * world
    cu = _as_cu(cu_q, "cu_seq_lens_q", who)
    if _as_cu(cu_k, "cu_seq_lens_k", who) != cu:
        raise ValueError(f"{who}: cu_seq_lens_k must equal cu_seq_lens_q (self-attention over one sequence)")
    if cu[-1] != seq_len:
        raise ValueError(
            f"{who}: cu_seq_lens_q ends at {cu[-1]}, but the global sequence is {local} local tokens x "
            f"{world} ranks = {seq_len}: pass the GLOBAL document boundaries (shard_batch gives them)"
        )
    return check_cu_seqlens(cu, seq_len, f"{who}: cu_seq_lens_q")  # empty documents (repeats) dropped


def _mismatch(ctx: Context, who: str) -> str:
    return (
        f"{who}: position_ids do not match the documents of cu_seq_lens_q on rank {ctx.rank}: expected the "
        "positions restarting at 0 in each document (or the global positions), sharded like the tokens "
        f"with balance {ctx.balance!r}; shard_batch gives both"
    )


def _not_global(ctx: Context, seq_len: int, who: str) -> str:
    return (
        f"{who}: position_ids on rank {ctx.rank} of {ctx.world_size} are not the global positions of this rank's "
        f"tokens (the shard of arange({seq_len}) with balance {ctx.balance!r}); a model given no position_ids "
        "numbers each shard from 0, which is wrong under context parallelism. Pass the position_ids of "
        "shard_batch; for packed documents (positions restarting at 0) also pass cu_seq_lens_q/cu_seq_lens_k "
        "with the global boundaries (shard_batch(..., cu_seqlens=...) gives them)"
    )


def _documents_traced(ctx: Context, query: torch.Tensor, kwargs: dict, who: str) -> list[int] | None:
    """:func:`_documents` under torch.compile: the same boundaries and checks, none of them a host read.

    - ``cu_seq_lens_q/k`` must be lists of ints (constants of the graph; ``batch.model_kwargs(compiled=True)``
      gives them): a tensor would be read on the host inside the graph, so it raises a ValueError;
    - the position_ids are checked on the device (``torch._assert_async``: a RuntimeError with the same
      message on the CPU; on an accelerator a device-side assert, which is asynchronous and ends the
      process), in the graph, once per layer, since nothing may be cached across calls by object identity;
    - position_ids that restart without ``cu_seq_lens_q/k`` (transformers' own packing rule, which eager
      follows on one rank) are not turned into documents: that needs the positions on the host. Under
      compile they fail the check of the global positions; pass the boundaries instead.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    for name, x in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if isinstance(x, torch.Tensor):
            raise ValueError(
                f"{who}: {name}: under torch.compile pass the GLOBAL document boundaries as a list of ints "
                "(a tensor would be read on the host inside the graph; batch.model_kwargs(compiled=True) gives "
                "lists); got a tensor"
            )
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() != 2:
        pos = None  # multi-axis positions (mrope): nothing to check here
    local = query.shape[2]
    cu = _boundaries(ctx, local, cu_q, cu_k, who)
    if pos is not None:
        index = _global_index(ctx, local, pos.device)
        if cu is not None:
            expect = _restarting(cu, pos.device)[index]
            torch._assert_async((pos == expect).all() | (pos == index).all(), _mismatch(ctx, who))
        else:
            torch._assert_async((pos == index).all(), _not_global(ctx, local * ctx.world_size, who))
    return None if cu is None or len(cu) <= 2 else list(cu)


def _documents_uncached(
    ctx: Context, query: torch.Tensor, pos: torch.Tensor | None, cu_q: Any, cu_k: Any, who: str
) -> tuple[int, ...] | None:
    local, world = query.shape[2], ctx.world_size
    seq_len = local * world
    cu = _boundaries(ctx, local, cu_q, cu_k, who)
    if pos is None:
        return None if cu is None or len(cu) <= 2 else cu
    index = _global_index(ctx, local, pos.device)
    if cu is not None:
        expect = _restarting(cu, pos.device)[index]
        if not (bool((pos == expect).all()) or bool((pos == index).all())):
            raise ValueError(_mismatch(ctx, who))
        return None if len(cu) <= 2 else cu
    if bool((pos == index).all()):
        return None
    if world == 1 and pos.shape[0] == 1:  # the whole sequence is here: transformers' own packing rule
        step = torch.diff(pos[0], prepend=pos[0, :1] - 1)
        starts = torch.nonzero(step != 1).flatten().tolist()
        return tuple([0, *(s for s in starts if s), seq_len])
    raise ValueError(_not_global(ctx, seq_len, who))


# --------------------------------------------------------------------------------------------------------
# The mask function


_MASK_PARTS = frozenset(
    {
        "causal_mask_function",
        "bidirectional_mask_function",
        "and_masks.<locals>.and_mask",
        "sliding_window_overlay.<locals>.inner_mask",
        "sliding_window_bidirectional_overlay.<locals>.inner_mask",
        "packed_sequence_mask_function.<locals>.inner_mask",
        "remap_positions_for_packed_sequence.<locals>.inner_mask",
    }
)
"""The pieces of transformers' mask functions that the attention function serves by itself: causal or
not (module.is_causal), the sliding window (sliding_window=) and packed documents (the documents of the
position_ids, which transformers also sees in the sharded positions); attention chunks too, checked by
:func:`xcp.integrations.transformers_variants.check_chunk_part`."""


def _mask_parts(fn: Any, seen: set[int] | None = None) -> list[Any]:
    """``fn`` and the mask functions its closure holds (and_masks keeps them in a tuple)."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    parts = [fn]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if callable(item) and hasattr(item, "__code__"):
                parts += _mask_parts(item, seen)
    return parts


@dataclass(frozen=True)
class WindowMask:
    """What :func:`mask_forward` returns for a sliding-window mask: the window it accepted (transformers'
    ``sliding_window`` W: query i sees keys ``i - W < j <= i``), carried to the attention function as its
    ``attention_mask``. Some models build a window mask but never pass ``sliding_window=`` to the
    attention call (PhiMoE; Qwen2-MoE with ``use_sliding_window``): the window reaches xcp this way."""

    window: int


def mask_forward(
    *args: Any, mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> WindowMask | None:
    """transformers' mask interface for xcp: no mask tensor (the attention function knows the pattern;
    a sliding window comes back as a :class:`WindowMask`, read from the mask function's sliding-window
    piece), and an error for what it cannot serve: a padding ``attention_mask`` or a mask function with other
    pieces (attention chunks, bidirectional blocks of image tokens, a caller's or_mask/and_mask).

    The sizes and offsets (``batch_size``, ``q_length`` or ``cache_position``, ``kv_length``, ...; their
    names differ between transformers versions) are not needed."""
    config = kwargs.get("config")
    who = f"xcp attention mask{f' of a {type(config).__name__} model' if config is not None else ''}"
    if torch.compiler.is_compiling():
        return _mask_traced(config, attention_mask, who, kwargs.get("local_size"))
    if config is not None and not config_prepared(config):
        raise ValueError(unprepared(who))
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            f"{who}: the attention_mask pads {int((~attention_mask.bool()).sum())} token(s); padding inside a "
            "context-parallel sequence is not supported: pack the documents into one sequence instead "
            "(shard_batch(..., cu_seqlens=...) or position_ids that restart at 0) and leave attention_mask out"
        )
    window = None
    if mask_function is not None:
        for part in _mask_parts(mask_function):
            name = getattr(part, "__qualname__", repr(part))
            ours = getattr(part, "__module__", None) == "transformers.masking_utils"
            if ours and name == CHUNK_PART:
                check_chunk_part(part, config, who)
                continue
            if ours and name in _WINDOW_PARTS:
                window = _closure_value(part, "sliding_window")
            if not ours or name not in _MASK_PARTS:
                raise ValueError(
                    f"{who}: the mask function has a part xcp does not serve: {getattr(part, '__module__', '?')}."
                    f"{name} (xcp serves causal or full attention, sliding windows, attention chunks and packed "
                    "documents; not bidirectional token blocks or custom or_mask/and_mask functions)"
                )
    return None if window is None else WindowMask(int(window))


_WINDOW_PARTS = frozenset(
    {"sliding_window_overlay.<locals>.inner_mask", "sliding_window_bidirectional_overlay.<locals>.inner_mask"}
)


def _closure_value(fn: Any, name: str) -> Any:
    """The value of the variable ``name`` that the closure ``fn`` holds."""
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def _mask_traced(config: Any, attention_mask: torch.Tensor | None, who: str, local_size: Any) -> WindowMask | None:
    """:func:`mask_forward` under torch.compile, without a host read or a look into closures.

    - a padding ``attention_mask`` fails a device-side check (``torch._assert_async``: a RuntimeError on
      the CPU, a device-side assert on an accelerator) instead of the ValueError of eager;
    - the mask function is NOT taken apart: dynamo cannot read the cells of a closure made inside the
      graph. Attention chunks come from the config (``attention_chunk_size``), which the attention function
      reads; a caller's ``or_mask_function``/``and_mask_function`` (bidirectional blocks of image tokens) goes
      unnoticed under compile: run such a model eagerly once to have it refused;
    - the window of a sliding-window mask is transformers' ``local_size`` (the closure holds the same
      number), except where it is the config's ``attention_chunk_size`` (a chunked mask passes its chunk as
      ``local_size``): a model with a sliding window as long as its attention chunk must run eagerly.
    """
    if attention_mask is not None:
        torch._assert_async(
            attention_mask.all(),
            f"{who}: the attention_mask pads token(s); padding inside a context-parallel sequence is not supported: "
            "pack the documents into one sequence instead (shard_batch(..., cu_seqlens=...) or position_ids that "
            "restart at 0) and leave attention_mask out",
        )
    if local_size is None or local_size == getattr(config, "attention_chunk_size", None):
        return None
    return WindowMask(int(local_size))


# --------------------------------------------------------------------------------------------------------
# The batch


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's part of a batch, with what must be computed on the whole sequence first.

    :ivar input_ids: ``[B, S/P]`` this rank's tokens.
    :ivar position_ids: ``[B, S/P]`` their GLOBAL positions (restarting at 0 in each packed document),
        sharded like the tokens.
    :ivar shift_labels: ``[B, S/P]`` the labels shifted on the whole sequence (token t is labelled with
        token t + 1; the last with -100), then sharded; None without labels.
    :ivar num_items_in_batch: the number of labels other than -100 in the WHOLE batch (all ranks), by which
        each rank divides its sum of losses; None without labels.
    :ivar cu_seqlens: the global document boundaries (int32, on the CPU), None for one document per row.
    :ivar padded: the tokens ``shard_batch(..., pad=True)`` appended to every row (0: none), the last of
        the whole sequence; :meth:`unpad` cuts them off an unsharded output.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor | None = None
    num_items_in_batch: int | None = None
    cu_seqlens: torch.Tensor | None = None
    padded: int = 0

    def unpad(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x`` (an output of the WHOLE padded sequence, e.g. ``xcp.unshard``-ed logits) without the
        :attr:`padded` tokens at its end along ``dim``: a view of the real tokens."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor; got {type(x).__name__}")
        dim = check_dim(x, dim)
        if x.shape[dim] <= self.padded:
            raise ValueError(
                f"x.shape[{dim}]: expected the whole padded sequence (more than the {self.padded} padded tokens; "
                f"xcp.unshard the ranks' outputs first); got {x.shape[dim]}"
            )
        return x.narrow(dim, 0, x.shape[dim] - self.padded)

    def model_kwargs(self, compiled: bool = False) -> dict[str, Any]:
        """The keyword arguments for ``model(**...)``: input_ids, position_ids, use_cache=False; with labels
        ``labels`` and ``shift_labels`` (transformers' causal-LM loss uses shift_labels and computes a loss
        only when labels is given) and ``num_items_in_batch``; with documents ``cu_seq_lens_q/k`` and
        ``max_length_q/k``.

        :param compiled: for a model under ``torch.compile``: the documents' boundaries as a list of ints
            (constants of the graph) rather than a tensor, which a graph would have to read on the host.
        """
        kw: dict[str, Any] = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.shift_labels is not None:
            kw.update(labels=self.shift_labels, shift_labels=self.shift_labels)
            kw["num_items_in_batch"] = self.num_items_in_batch
        if self.cu_seqlens is not None:
            longest = int(self.cu_seqlens.diff().max())
            cu = self.cu_seqlens.tolist() if compiled else self.cu_seqlens
            kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
            kw.update(max_length_q=longest, max_length_k=longest)
        return kw


def _check_2d(name: str, x: Any, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor; got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected 2 dims [batch, seq] (the whole sequence); got shape {tuple(x.shape)}")
    if shape is not None and (x.shape[1] != shape[1] or x.shape[0] not in (1, shape[0])):
        raise ValueError(f"{name}: expected shape {shape} (that of input_ids); got {tuple(x.shape)}")
    return x


def shard_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    ctx: Context | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    ignore_index: int = IGNORE_INDEX,
    pad: bool = False,
    pad_token_id: int = 0,
) -> ShardedBatch:
    """This rank's part of a batch of WHOLE sequences (equal on every rank of the context).

    :param input_ids: ``[B, S]`` the tokens; S a multiple of what the context's balance needs (2P for zigzag),
        or any length with ``pad=True``.
    :param labels: ``[B, S]`` unshifted labels as transformers takes them (often ``input_ids``), -100 where no
        loss is wanted; shifted here on the whole sequence, then sharded.
    :param attention_mask: accepted only without padding (all ones); padding inside a context-parallel
        sequence is not supported: pack documents instead (``cu_seqlens`` or ``position_ids``).
    :param ctx: the context (default: the current one, :func:`xcp.context.current`).
    :param position_ids: ``[B, S]`` the model's positions; packed documents restart at 0 (a step other than
        +1 starts a document, as in transformers; batch 1). Default ``arange(S)``, or restarting in each
        document of ``cu_seqlens``.
    :param cu_seqlens: the global boundaries ``[0, ..., S]`` of packed documents (batch 1); a repeated
        boundary is an empty document, dropped (the batch's ``cu_seqlens`` has none). A label that
        crosses into the next document is kept, as transformers does on one device: make the first label
        of each document -100 (as ``DataCollatorWithFlattening`` does) to leave it out.
    :param ignore_index: the label that is left out of the loss.
    :param pad: append ``pad_token_id`` tokens up to the next length the context's balance splits
        (:func:`xcp.padding.padded_length`), their labels ``ignore_index``, so that the loss, its count
        and every gradient are those of the unpadded batch; the batch's ``padded`` says how many
        (:meth:`ShardedBatch.unpad` cuts them off unsharded outputs). Batch 1: the padding is a document of
        its own (appended to ``cu_seqlens``, or ``[0, S, S + pad]``), its positions restarting at 0; nothing
        sees it and it sees nothing else, causal or not. Batch > 1: each row is padded at its end and the
        positions continue; exact under causal attention only (no real token sees a later one), so the
        attention function refuses such a batch in a bidirectional layer: pack the rows into batch 1.
        Tokens the model runs still: what it computes over all tokens besides attention and the loss (a
        mixture-of-experts router's load-balancing loss) counts them.
    :param pad_token_id: the id of the padding tokens; it does not change the result.
    """
    ctx = current() if ctx is None else ctx
    if not isinstance(ctx, Context):
        raise TypeError(f"ctx: expected an xcp.context or None; got {type(ctx).__name__}")
    input_ids = _check_2d("input_ids", input_ids)
    batch, seq_len = input_ids.shape
    if attention_mask is not None:
        _check_2d("attention_mask", attention_mask, (batch, seq_len))
        if not bool(attention_mask.all()):
            raise ValueError(
                f"attention_mask: pads {int((attention_mask == 0).sum())} token(s); padding inside a "
                "context-parallel sequence is not supported: pack the documents into one sequence instead "
                "(cu_seqlens= or position_ids= restarting at 0)"
            )
    device = input_ids.device
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens: packed documents need batch 1; input_ids has batch {batch}")
        cu = _as_cu(cu_seqlens, "cu_seqlens", "cu_seqlens")
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(
                f"cu_seqlens: expected non-decreasing boundaries from 0 to {seq_len} (a repeat is an empty "
                f"document); got {list(cu)}"
            )
        cu = check_cu_seqlens(cu, seq_len)  # empty documents dropped: the model sees strictly increasing ones
        if position_ids is None:
            position_ids = _restarting(cu, device).unsqueeze(0)
    elif position_ids is not None:
        _check_2d("position_ids", position_ids, (batch, seq_len))
        step = torch.diff(position_ids, dim=1)
        if bool((step != 1).any()):
            if position_ids.shape[0] != 1:
                shape = tuple(position_ids.shape)
                raise ValueError(f"position_ids: restart (packed documents), which needs batch 1; got shape {shape}")
            starts = (torch.nonzero(step[0] != 1).flatten() + 1).tolist()
            cu = (0, *starts, seq_len)
        else:
            cu = None
    else:
        cu = None
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=device).unsqueeze(0)
    _check_2d("position_ids", position_ids, (batch, seq_len))
    position_ids = position_ids.to(device).expand(batch, seq_len)
    padded = 0
    if not schedule.is_bool(pad):
        raise TypeError(f"pad: expected True or False; got {pad!r}")
    if pad:
        if labels is not None:
            labels = _check_2d("labels", labels, (batch, seq_len)).expand(batch, seq_len)
        input_ids, position_ids, labels, cu, padded = _pad(
            ctx, input_ids, position_ids, labels, cu, pad_token_id, ignore_index
        )
        seq_len = input_ids.shape[1]
    else:
        _check_splits(ctx, seq_len)
    shift_labels = count = None
    if labels is not None:
        labels = _check_2d("labels", labels, (batch, seq_len)).expand(batch, seq_len)
        shift_labels = torch.cat([labels[:, 1:], labels.new_full((batch, 1), ignore_index)], dim=1)
        count = int((shift_labels != ignore_index).sum())
        shift_labels = ctx.shard(shift_labels)
    positions = ctx.shard(position_ids)
    if padded and batch > 1:  # the attention function refuses these rows in a bidirectional layer
        setattr(positions, _PADDED_ROWS, padded)
    return ShardedBatch(
        input_ids=ctx.shard(input_ids),
        position_ids=positions,
        shift_labels=shift_labels,
        num_items_in_batch=count,
        cu_seqlens=None if cu is None or len(cu) <= 2 else torch.tensor(cu, dtype=torch.int32),
        padded=padded,
    )


def _check_splits(ctx: Context, seq_len: int) -> None:
    """A ValueError that says ``pad=True`` unless the context's balance splits ``seq_len``."""
    fits = padded_length(seq_len, ctx.world_size, ctx.balance, ctx.ulysses) if seq_len > 0 else seq_len
    if fits != seq_len:  # (no token at all: shard says so)
        raise ValueError(
            f"input_ids: expected a length that balance {ctx.balance!r} splits over {ctx.world_size} ranks "
            f"(the next is {fits}); got {seq_len}: pass pad=True to pad it with tokens no real token sees"
        )


def _pad(
    ctx: Context,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor | None,
    cu: tuple[int, ...] | None,
    pad_token_id: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, ...] | None, int]:
    """``shard_batch(..., pad=True)``: the tokens, positions and labels ``[B, S]`` padded to the length the
    context splits, the documents (batch 1: the padding one appended), and the number of tokens padded."""
    if not schedule.is_integer(pad_token_id) or pad_token_id < 0:
        raise ValueError(f"pad_token_id: expected a token id (an integer >= 0); got {pad_token_id!r}")
    batch = input_ids.shape[0]
    place: dict[str, Any] = {"world_size": ctx.world_size, "balance": ctx.balance, "ulysses": ctx.ulysses}
    documents = cu if batch == 1 else None
    input_ids, bounds, n = pad_to_balance(input_ids, value=int(pad_token_id), cu_seqlens=documents, **place)
    if n == 0:
        return input_ids, position_ids, labels, cu, 0
    if labels is not None:
        labels = pad_to_balance(labels, value=ignore_index, **place)[0]
    more = torch.arange(n, device=position_ids.device, dtype=position_ids.dtype).expand(batch, n)
    if batch == 1:  # a document of its own: its positions restart at 0
        assert bounds is not None
        cu = tuple(bounds.tolist())
    else:  # the end of every row: the positions continue
        more = more + position_ids[:, -1:] + 1
    return input_ids, torch.cat([position_ids, more], dim=1), labels, cu, n


# --------------------------------------------------------------------------------------------------------
# Gradients


def reduce_gradients(parameters: Iterable[torch.nn.Parameter], ctx: Context | None = None) -> None:
    """SUM each parameter's gradient over the ranks of the context (torch.distributed all-reduce).

    Every rank's gradient is its tokens' share of the gradient of the global loss (the loss being divided
    by the global ``num_items_in_batch``), so the ranks' gradients add up; an average would be P times too
    small. Plain DDP over the ranks of the sequence averages: scale the loss by P there instead (or sum
    with this function and leave DDP out of the context-parallel group).

    Virtual ranks of a :class:`xcp.LocalWorld` that share one model need nothing: autograd adds every
    rank's backward into the same ``.grad``. Giving this function a LocalWorld group raises a TypeError.
    """
    ctx = current() if ctx is None else ctx
    if ctx.world_size == 1:
        return
    import torch.distributed as dist

    group = ctx.group
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"reduce_gradients: group {group!r} is not a torch.distributed ProcessGroup; virtual ranks sharing one "
            "model already sum into .grad (with a model per rank, add their .grad yourself)"
        )
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)


# --------------------------------------------------------------------------------------------------------
# Generation


def generate(
    model: Any,
    input_ids: torch.Tensor,
    group: Any = None,
    max_new_tokens: int = 16,
    balance: str = "zigzag",
    **generate_kwargs: Any,
) -> Any:
    """``model.generate(input_ids, max_new_tokens=..., **generate_kwargs)`` with the KV cache sharded across
    the ranks of ``group``; returns what that returns on one device (token ids ``[B, L + new]``, or the output
    object with ``return_dict_in_generate=True``), the same on every rank.

    Call it on every rank with the same model weights, prompt and options, the model built or switched to
    ``attn_implementation="xcp"`` (:func:`register`). The prompt's longest prefix that ``balance`` can split
    (leaving at least one token) is prefilled through the ring, each rank keeping its shard of every layer's
    keys and values (one :class:`xcp.KVCache` per layer); the rest of the prompt goes in as one chunk and
    then every new token runs through the whole model on every rank, attention combining the ranks'
    partials (one collective per layer and step). Recurrent layers (after :func:`prepare`) run the prefix
    with state passing and keep their states whole on every rank, advanced by every rank without
    communication; for such models the rest of the prompt goes in one token at a time (docs/hybrid.md).
    Rank 0 chooses each token (greedy, or sampled with its default generator: ``torch.manual_seed`` before
    the call seeds it as on one device) and every rank takes it, so the ranks never drift apart.

    :param group: the ranks that share the cache (a ProcessGroup, a LocalWorld group, None: the default
        process group or a world of one), as for :func:`xcp.attention`.
    :param balance: how the prompt's prefix is placed on the ranks for the ring.
    A ragged batch (an ``attention_mask`` with left padding, as a tokenizer with ``padding_side="left"`` makes
    it) is generated one row at a time, without its padding, and laid out as ``model.generate`` lays out the
    batch (greedy, token ids only).

    :raises ValueError: an ``attention_mask`` padded other than on the left, a model whose attention is not
        xcp's, and the options the sharded cache cannot serve (beam search, several sequences per prompt,
        assisted decoding, a cache of the caller's, ``use_cache=False``).
    """
    transformers = _transformers()
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None or transformers.AttentionInterface().get(impl) is not attention_forward:
        raise ValueError(
            f"model: expected attention by xcp (register(), then from_config(..., attn_implementation='xcp') or "
            f"model.set_attn_implementation('xcp')); got attn_implementation {impl!r}"
        )
    if not is_prepared(model):
        raise ValueError(unprepared("model"))
    from .transformers_generate import generate as run

    mask = generate_kwargs.get("attention_mask")
    pads = None if mask is None or not isinstance(input_ids, torch.Tensor) else left_padding(mask, input_ids)
    if pads is not None:  # a ragged batch: its rows one at a time
        return generate_ragged(run, model, input_ids, pads, group, max_new_tokens, balance, generate_kwargs)
    return run(model, input_ids, group, max_new_tokens, balance, generate_kwargs)
