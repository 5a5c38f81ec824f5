"""``prepare(model)``: make every layer of a transformers model context-parallel, or refuse it, before use.

Under :func:`xcp.context` every rank runs the whole model on its shard of the sequence and only xcp's
attention function talks to the other ranks. A layer that mixes tokens any other way (its own attention
code, a recurrence, a convolution over the sequence, an indexer that ranks every key) would see its shard
alone and be silently wrong. :func:`prepare` walks the model once and, for each module:

1. the first registered **adapter** that matches it (:func:`register_layer`) makes it context-parallel:
   its ``adapt(module)`` returns a replacement module (put where the module was) or None (adapted in place);
2. else the first **refusal** that matches it (:func:`refuse_layer`) is collected; after the walk, a
   ValueError lists every refused layer class with the reason (nothing is changed then);
3. every module of the model is then marked prepared (:func:`is_prepared`).

Adapters take precedence over refusals, so a module that makes a family context-parallel registers its
adapter and the built-in refusal of that family no longer applies; it never edits this module::

    from xcp.integrations.transformers_prepare import register_layer
    register_layer("Qwen3NextGatedDeltaNet", make_context_parallel, name="gated delta net")

xcp's attention and mask functions refuse a module that was not prepared (:func:`is_prepared`,
:func:`config_prepared`), so a model used with ``attn_implementation="xcp"`` without ``prepare`` fails at
its first forward, whatever layers it has (recurrent ones included: nothing needs adding for them), instead
of running any layer over a shard alone. A prepared model also runs every :func:`add_forward_check`
before each forward (xcp's own: under a context of more than one rank its attention must still be
xcp's); a family whose layers need a model-wide condition adds one there. :func:`prepare` is idempotent
(a prepared module is neither adapted nor checked again) and returns the model. Nothing here imports
transformers.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Match = Callable[[torch.nn.Module], bool] | str | type
"""What a rule applies to: a predicate over modules, a class (``isinstance``), or a class name (the
class's ``__name__``, or with a dot its ``module.qualname``)."""

MARK = "_xcp_prepared"
"""The attribute :func:`prepare` sets on every module of a prepared model."""


@dataclass(frozen=True)
class Adapter:
    """A registered way to make a layer context-parallel (:func:`register_layer`)."""

    name: str
    match: Match
    adapt: Callable[[torch.nn.Module], torch.nn.Module | None]


@dataclass(frozen=True)
class Refusal:
    """A registered layer xcp cannot make right, with the reason (:func:`refuse_layer`)."""

    name: str
    match: Match
    why: str | Callable[[torch.nn.Module], str]

    def reason(self, module: torch.nn.Module) -> str:
        return self.why(module) if callable(self.why) else self.why


_lock = threading.Lock()
_adapters: list[Adapter] = []
_refusals: list[Refusal] = []


def _add(rules: list[Any], rule: Adapter | Refusal) -> Any:
    """Append ``rule`` to ``rules`` after checking its name and match; return it."""
    name, match = rule.name, rule.match
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string; got {name!r}")
    if not (isinstance(match, (str, type)) or callable(match)):
        raise TypeError(f"match: expected a class, a class name or a predicate over modules; got {match!r}")
    with _lock:
        if any(r.name == name for r in _adapters) or any(r.name == name for r in _refusals):
            raise ValueError(f"name: expected a name not registered yet; got {name!r} (unregister_layer it first)")
        rules.append(rule)
    return rule


def register_layer(match: Match, adapt: Callable[[torch.nn.Module], torch.nn.Module | None], *, name: str) -> Adapter:
    """Register ``adapt`` for the modules that ``match``; return the :class:`Adapter`.

    :param match: a class, a class name, or a predicate ``match(module) -> bool``.
    :param adapt: called once per matching module by :func:`prepare`: returns the module that replaces it
        (xcp marks it and everything under it prepared; its children are not walked again) or None
        when it changed the module in place. It raises to refuse one instance (say why).
    :param name: unique; :func:`unregister_layer` takes it. Adapters are tried in registration order and
        before every refusal.
    """
    if not callable(adapt):
        raise TypeError(f"adapt: expected a callable(module) -> module or None; got {adapt!r}")
    return _add(_adapters, Adapter(name, match, adapt))


def refuse_layer(match: Match, why: str | Callable[[torch.nn.Module], str], *, name: str) -> Refusal:
    """Make :func:`prepare` refuse the modules that ``match`` (unless an adapter matches them first).

    :param why: the reason, or ``why(module) -> str``; the error reads ``<class>: <why>``.
    """
    if not (isinstance(why, str) and why) and not callable(why):
        raise ValueError(f"why: expected a non-empty string or a callable(module) -> str; got {why!r}")
    return _add(_refusals, Refusal(name, match, why))


def unregister_layer(name: str) -> None:
    """Remove the adapter or refusal registered as ``name`` (a KeyError if there is none)."""
    with _lock:
        kinds: tuple[list[Any], ...] = (_adapters, _refusals)
        for rules in kinds:
            names = [rule.name for rule in rules]
            if name in names:
                del rules[names.index(name)]
                return
    raise KeyError(f"name: no adapter or refusal registered as {name!r}")


def adapters() -> tuple[Adapter, ...]:
    """The registered adapters, in the order :func:`prepare` tries them."""
    with _lock:
        return tuple(_adapters)


def refusals() -> tuple[Refusal, ...]:
    """The registered refusals, in the order :func:`prepare` tries them."""
    with _lock:
        return tuple(_refusals)


def matches(match: Match, module: torch.nn.Module) -> bool:
    """Whether ``module`` is one that ``match`` names (see :data:`Match`)."""
    if isinstance(match, str):
        cls = type(module)
        return match == (f"{cls.__module__}.{cls.__qualname__}" if "." in match else cls.__name__)
    if isinstance(match, type):
        return isinstance(module, match)
    return bool(match(module))


# --------------------------------------------------------------------------------------------------------
# prepare


ForwardCheck = Callable[[torch.nn.Module], None]
"""``check(model)`` before every forward of a prepared model; it raises to refuse the forward."""

_forward_checks: list[ForwardCheck] = []


def add_forward_check(check: ForwardCheck) -> ForwardCheck:
    """Run ``check(model)`` before every forward of every model :func:`prepare` saw (where xcp sees what a
    module's own code cannot: the model's attention implementation, its layers); return ``check``."""
    if not callable(check):
        raise TypeError(f"check: expected a callable(model) -> None; got {check!r}")
    with _lock:
        if check not in _forward_checks:
            _forward_checks.append(check)
    return check


def _before_forward(model: torch.nn.Module, args: Any) -> None:
    for check in tuple(_forward_checks):
        check(model)


_configs: dict[int, Callable[[], Any]] = {}
"""The configs of prepared models (by id, with a weak reference to tell a reused id): the mask function
sees the config, not the modules."""


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """Make every supported layer of ``model`` context-parallel under :func:`xcp.context`; return ``model``.

    Idempotent. Raises a ValueError listing every layer class that xcp cannot make right and why (the model
    is left unchanged then). Call it once after building the model (and before ``torch.compile``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model); got {type(model).__name__}")
    with _lock:
        rules, refused = list(_adapters), list(_refusals)
    problems: dict[str, str] = {}
    plan: list[tuple[torch.nn.Module, str, torch.nn.Module, Adapter]] = []
    _walk(None, "", model, rules, refused, plan, problems)
    if problems:
        listed = "; ".join(f"{cls}: {why}" for cls, why in problems.items())
        what = type(model).__name__
        raise ValueError(f"model: xcp cannot make every layer of this {what} context-parallel: {listed}")
    for parent, name, module, rule in plan:
        new = rule.adapt(module)
        if new is not None and new is not module:
            if not isinstance(new, torch.nn.Module):
                raise TypeError(f"adapter {rule.name!r}: expected a torch.nn.Module or None; got {type(new).__name__}")
            if parent is None:
                raise ValueError(f"adapter {rule.name!r}: cannot replace the model itself; adapt it in place")
            setattr(parent, name, new)
            _mark(new)
    _mark(model)
    if not getattr(model, "_xcp_forward_checked", False):
        model.register_forward_pre_hook(_before_forward)
        object.__setattr__(model, "_xcp_forward_checked", True)
    return model


def _walk(
    parent: torch.nn.Module | None,
    name: str,
    module: torch.nn.Module,
    rules: list[Adapter],
    refused: list[Refusal],
    plan: list[tuple[Any, str, torch.nn.Module, Adapter]],
    problems: dict[str, str],
    path: str = "",
    inside: bool = False,
) -> None:
    """Find each unprepared module's adapter (into ``plan``) or refusal (into ``problems``), top down; the
    children of an adapted module are its adapter's business."""
    if getattr(module, MARK, False):
        return
    rule = next((r for r in rules if matches(r.match, module)), None)
    if rule is not None:
        plan.append((parent, name, module, rule))
        return
    refusal = next((r for r in refused if matches(r.match, module)), None)
    generic = type(module).__module__.startswith("torch.")  # a class of torch's own (Conv1d): where it is
    if refusal is not None and not (generic and inside):  # inside a refused layer: refused with it
        label = f"{type(module).__name__} ({path})" if generic and path else type(module).__name__
        problems.setdefault(label, refusal.reason(module))
    for child_name, child in module.named_children():
        child_path = f"{path}.{child_name}".lstrip(".")
        _walk(module, child_name, child, rules, refused, plan, problems, child_path, inside or refusal is not None)


def _mark(model: torch.nn.Module) -> None:
    for dead in [key for key, ref in _configs.items() if ref() is None]:  # configs of models gone
        del _configs[dead]
    for module in model.modules():
        object.__setattr__(module, MARK, True)
        config = getattr(module, "config", None)
        if config is not None:
            try:
                _configs[id(config)] = weakref.ref(config)
            except TypeError:  # a config that takes no weak reference: kept alive with the table
                _configs[id(config)] = functools.partial(_same, config)


def _same(x: Any) -> Any:
    return x


def is_prepared(module: Any) -> bool:
    """Whether ``module`` (a model or any module of it) went through :func:`prepare`."""
    return bool(getattr(module, MARK, False))


def config_prepared(config: Any) -> bool:
    """Whether ``config`` belongs to a model that went through :func:`prepare`."""
    ref = _configs.get(id(config))
    return ref is not None and ref() is config


def unprepared(what: str) -> str:
    """The message for a model used with xcp's attention without :func:`prepare`."""
    return (
        f"{what}: the model was not prepared for context parallelism: call "
        "xcp.integrations.transformers.prepare(model) once after building it (it makes every layer "
        "context-parallel, and refuses, naming the layer, what xcp cannot make right: layers that mix the "
        "sequence outside attention, such as state-space, linear-attention and convolution layers, and "
        "attention computed outside transformers' attention interface)"
    )


# --------------------------------------------------------------------------------------------------------
# What xcp refuses out of the box


_OWN_ATTENTION = (
    "computes attention itself, outside transformers' attention interface (attn_implementation), so xcp's "
    "attention is never called and each rank would attend over its own shard alone"
)

_BYPASSING = {
    "bloom.BloomAttention": " (ALiBi scores and its own softmax)",
    "mpt.MptAttention": " (ALiBi position bias and its own softmax)",
    "cpmant.CpmAntAttention": " (a relative position bias and its own softmax)",
    "gpt_neox_japanese.GPTNeoXJapaneseAttention": " (its own matmul and softmax)",
    "openai.Attention": " (OpenAI-GPT's own matmul and softmax)",
    "reformer.LSHSelfAttention": " (locality-sensitive hashing buckets)",
    "reformer.LocalSelfAttention": " (local chunks of its own)",
    "xglm.XGLMAttention": " (its own matmul and softmax)",
    "xlnet.XLNetRelativeAttention": " (two-stream relative attention)",
    "falcon.FalconAttention": " (Falcon picks it from its own table, FALCON_ATTENTION_CLASSES)",
    "falcon.FalconFlashAttention2": " (Falcon picks it from its own table, FALCON_ATTENTION_CLASSES)",
    "gpt_neo.GPTNeoSelfAttention": " (GPT-Neo picks it from its own table, GPT_NEO_ATTENTION_CLASSES)",
    "gpt_neo.GPTNeoFlashAttention2": " (GPT-Neo picks it from its own table, GPT_NEO_ATTENTION_CLASSES)",
}
"""Attention modules of transformers that never call the attention interface: ``model.Class`` (the
module ``transformers.models.<model>.modeling_<model>``) and what they do instead."""


_PROJECTIONS = frozenset(
    {"q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv_proj", "c_attn", "query_key_value", "q_lin", "k_lin"}
)
"""Names transformers gives an attention module's query/key/value projections."""

_INTERFACE = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "_attn_implementation")
"""What the source of a forward that goes through transformers' attention interface mentions."""

_own_attention: dict[type, bool] = {}


def _computes_attention_itself(cls: type) -> bool:
    """Whether the transformers module class ``cls`` projects queries, keys and values (its modules have
    children of :data:`_PROJECTIONS`' names) in a forward that never reaches the attention interface."""
    if cls not in _own_attention:
        try:
            source = inspect.getsource(cls.forward)  # type: ignore[attr-defined]
        except (OSError, TypeError, AttributeError):  # no source to read: nothing to say
            source = _INTERFACE[0]
        _own_attention[cls] = not any(word in source for word in _INTERFACE)
    return _own_attention[cls]


def _model_of(cls: type) -> str | None:
    """``<model>`` of a class in ``transformers.models.<model>.modeling_<model>``, else None."""
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) >= 4 and parts[:2] == ["transformers", "models"] else None


def _bypassing(module: torch.nn.Module) -> bool:
    cls = type(module)
    model = _model_of(cls)
    if model is None:
        return False
    if f"{model}.{cls.__name__}" in _BYPASSING:
        return True
    children = {name for name, _ in module.named_children()}
    return len(children & _PROJECTIONS) >= 1 and "Attention" in cls.__name__ and _computes_attention_itself(cls)


def _bypassing_why(module: torch.nn.Module) -> str:
    cls = type(module)
    return _OWN_ATTENTION + _BYPASSING.get(f"{_model_of(cls)}.{cls.__name__}", " (its own matmul and softmax)")


def _numbers_from_zero(module: torch.nn.Module) -> bool:
    """A language model (it has output embeddings) with position embeddings whose forward takes no
    ``position_ids``: it numbers the tokens it is given from 0 (BART's and Whisper's decoders, RoFormer)."""
    if _model_of(type(module)) is None or not callable(getattr(module, "get_output_embeddings", None)):
        return False
    try:
        head = module.get_output_embeddings()  # type: ignore[operator]
        parameters = inspect.signature(module.forward).parameters
    except Exception:  # noqa: BLE001 - not a language model after all
        return False
    if head is None or "position_ids" in parameters:
        return False
    return any(_POSITIONAL.search(type(m).__name__) for m in module.modules())  # positions it makes itself


_POSITIONAL = re.compile(r"Positional|PositionEmbedding|RotaryEmbedding|RotaryPositional")
"""Class names of modules that turn positions into embeddings or rotations (a model without any, such as
Mamba or RWKV, needs no positions)."""


def _positions_from_ids(module: torch.nn.Module) -> bool:
    """RoBERTa's embeddings (and their copies): positions derived from the input ids when none are given."""
    return _model_of(type(module)) is not None and hasattr(module, "create_position_ids_from_input_ids")


_FROM_IDS = (
    "given no position_ids it numbers the tokens from padding_idx + 1, skipping padding, which is not what "
    "shard_batch's global positions (from 0) give it; xcp cannot tell which numbering the model was trained "
    "with, so it refuses rather than run another model than one device would"
)

_FROM_ZERO = (
    "its forward takes no position_ids: it numbers the tokens it is given from 0, so every rank would number "
    "its shard from 0 (context parallelism needs the global positions, shard_batch's position_ids)"
)


RECURRENT = frozenset(
    {
        "BailingHybridDeltaAttention",
        "BambaMixer",
        "FalconH1Mixer",
        "FalconMambaMixer",
        "GraniteMoeHybridMambaLayer",
        "JambaMambaMixer",
        "KimiDeltaAttention",
        "KimiLinearDeltaAttention",
        "LaraMiniGatedDeltaNet",
        "Lfm2ShortConv",
        "Lfm2MoeShortConv",
        "Lfm3ShortConv",
        "MambaMixer",
        "Mamba2Mixer",
        "MiniMaxLightningAttention",
        "NemotronHMamba2Mixer",
        "OlmoHybridGatedDeltaNet",
        "Qwen3_5GatedDeltaNet",
        "Qwen3_5MoeGatedDeltaNet",
        "Qwen3NextGatedDeltaNet",
        "RecurrentGemmaRecurrentBlock",
        "RwkvSelfAttention",
        "RwkvFeedForward",
        "xLSTMLayer",
        "ZambaMambaMixer",
        "Zamba2MambaMixer",
        "ZayaCCAProjection",
    }
)
"""transformers' layers (5.24) that mix the sequence outside attention: selective scans, the gated delta
rule, lightning attention, RG-LRU, RWKV's time mixing and token shift, mLSTM, short causal convolutions."""


_RECURRENT_NAMES = re.compile(r"(GatedDeltaNet|DeltaAttention|Mamba\d?Mixer|MambaLayer|ShortConv|LightningAttention)$")
"""The class names of such layers in families :data:`RECURRENT` does not list yet."""


def _recurrent(module: torch.nn.Module) -> bool:
    """A layer of :data:`RECURRENT` or named like one, or a depthwise convolution over the sequence (the
    short causal convolutions of hybrid layers) of width more than 1."""
    name = type(module).__name__
    if name in RECURRENT or _RECURRENT_NAMES.search(name):
        return True
    if isinstance(module, torch.nn.Conv1d):
        return module.kernel_size[0] > 1 and module.groups == module.in_channels > 1
    return False


def _recurrent_why(module: torch.nn.Module) -> str:
    what = "a convolution over the sequence" if isinstance(module, torch.nn.Conv1d) else "a recurrence or convolution"
    return (
        f"mixes the sequence outside attention ({what}); passing its state from rank to rank is not yet "
        "supported, so each rank would run it over its own shard alone"
    )


_DOGE = (
    "adds a learned dynamic mask to the attention scores (from the values: exp(A * softplus(dt_proj(v))) per "
    "key and head, keeping each query's keep_window_size largest), a bias over every key that xcp's attention "
    "does not take"
)
_INDEXER = (
    "sparse attention: this indexer scores every key for each query over the whole sequence (it reads the "
    "materialised mask) and keeps the top ones; context parallelism for the indexer is not supported"
)
_COMPRESSED = (
    "compressed KV: this compressor appends pooled summaries of earlier tokens to the keys (DeepSeek-V4's "
    "compressed and heavily compressed sparse attention); the summaries span the whole sequence, across the "
    "ranks, which xcp's attention does not serve"
)


def _named(pattern: str) -> Callable[[torch.nn.Module], bool]:
    rule = re.compile(pattern)
    return lambda module: rule.search(type(module).__name__) is not None


def _builtin() -> None:
    refuse_layer(_recurrent, _recurrent_why, name="recurrent layers")
    refuse_layer(_bypassing, _bypassing_why, name="attention outside the interface")
    refuse_layer("DogeAttention", _DOGE, name="Doge dynamic mask")
    refuse_layer(_named(r"Indexer$"), _INDEXER, name="sparse attention indexer")
    refuse_layer(_named(r"Compressor$"), _COMPRESSED, name="compressed KV")
    refuse_layer(_numbers_from_zero, _FROM_ZERO, name="positions from zero")
    refuse_layer(_positions_from_ids, _FROM_IDS, name="positions from the input ids")


_builtin()
