"""transformers' recurrent layers made context-parallel: adapters in :func:`prepare`'s registry.

The families' mixers call module-level kernels with a shared convention (``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``, ``causal_conv1d_fn``). The adapter of a mixer
instance puts a dispatcher in place of each such name in the mixer's modeling module (once per module) and
wraps the instance's ``forward``: while a prepared mixer runs under an :func:`xcp.context` of more than one
rank, the dispatchers run the kernel through :func:`xcp.recurrent.state_passing` or
:func:`xcp.recurrent.causal_conv` with the context's group and balance; anywhere else they call the
original kernel unchanged. The family's own forward code runs as written.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..context import current
from ..recurrent import Decay, DeltaRule, causal_conv, check_recurrent_balance, state_passing
from .transformers_prepare import register_layer


@dataclass(frozen=True)
class _Run:
    """The context a prepared recurrent mixer runs under: its group and balance."""

    group: Any
    balance: str
    layer: str
    documents: tuple[int, ...] | None = None
    """The packed documents' GLOBAL boundaries the mixer was called with (None: one sequence)."""
    ulysses: int = 1
    """The context's U: the tokens are placed as ``xcp.shard(..., ulysses=U)`` places them."""


_active = threading.local()


def _run() -> _Run | None:
    return getattr(_active, "run", None)


@contextmanager
def _running(run: _Run) -> Iterator[None]:
    before = _run()
    _active.run = run
    try:
        yield
    finally:
        _active.run = before


def _no_carry(run: _Run, name: str, value: Any) -> None:
    """Refuse a state carried in from a cache of the caller's under a context of more than one rank (state
    passing starts the sequence from a zero state; xcp's generate keeps the states of its own cache)."""
    if value is not None:
        raise NotImplementedError(
            f"{run.layer}: {name} from a cache under an xcp.context of more than one rank is not supported (the "
            "ranks' shards start the sequence; to go on from a prompt, use xcp.integrations.transformers.generate)"
        )


_DOCUMENTS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
"""The names packed documents' boundaries reach a mixer's kernels under: the model's forward passes
``cu_seq_lens_q/k`` (``shard_batch(..., cu_seqlens=).model_kwargs()``) on to the mixer and its kernels; the gated
delta families hand ``cu_seq_lens_q`` to their kernel as ``cu_seqlens``."""


def mixer_documents(layer: str, kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The documents' GLOBAL boundaries a mixer's call carries (None: one sequence): every kernel of the mixer
    restarts its state at each and its convolutions never cross one, also a kernel the mixer does not hand
    them to (Jamba's scan gets none, its convolution does). ``seq_idx`` (the mamba_ssm kernels' per-token
    document index, of a shard: a document starting at a shard's start cannot be told from one going on) is
    refused."""
    if kwargs.get("seq_idx") is not None:
        raise NotImplementedError(
            f"{layer}: seq_idx under an xcp.context of more than one rank: expected the documents as "
            "cu_seq_lens_q/cu_seq_lens_k (the global boundaries, shard_batch(..., cu_seqlens=).model_kwargs()); "
            "got seq_idx"
        )
    found: dict[str, tuple[int, ...]] = {}
    for name in _DOCUMENTS:
        value = kwargs.get(name)
        if value is not None:
            found[name] = tuple(int(x) for x in (value.tolist() if isinstance(value, torch.Tensor) else value))
    if len(set(found.values())) > 1:
        raise ValueError(
            f"{layer}: cu_seq_lens_k: expected the boundaries of cu_seq_lens_q (one sequence of packed documents); "
            f"got {found}"
        )
    return next(iter(found.values()), None)


def _cu(run: _Run, kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The documents a kernel call runs over: the mixer's (:func:`mixer_documents`; transformers' mixers hand
    their kernels the same ones, taken out of ``kwargs`` here: the kernel runs on pieces cut at them)."""
    for name in (*_DOCUMENTS, "seq_idx"):
        kwargs.pop(name, None)
    return run.documents


_TORCH_DELTA = ("chunk_size", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
_FLA_DELTA = ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
"""The positional arguments after ``beta``: transformers' torch kernels', and fla's ``chunk_gated_delta_rule``
and ``chunk_kda``'s (the names a modeling module holds where it imports fla's kernels itself)."""


def _delta(original: Callable[..., Any], run: _Run, query, key, value, g, beta, *args, _names=_TORCH_DELTA, **kwargs):
    """``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention`` (q, k, v, g, beta, chunk_size,
    initial_state, output_final_state, use_qk_l2norm_in_kernel), or fla's kernels of those (``_names``:
    :data:`_FLA_DELTA`), through state passing. fla's state is [N, H, K, V] float32, DeltaRule's layout."""
    kwargs.update(zip(_names, args))
    _no_carry(run, "initial_state", kwargs.pop("initial_state", None))
    cu = _cu(run, kwargs)
    final = bool(kwargs.pop("output_final_state", False))

    def kernel(q, k, v, g_, b_, initial_state=None, output_final_state=False):
        final_ = output_final_state
        return original(q, k, v, g=g_, beta=b_, initial_state=initial_state, output_final_state=final_, **kwargs)

    out, state = state_passing(
        kernel,
        query,
        key,
        value,
        g,
        beta,
        transition=DeltaRule(value=2),
        group=run.group,
        balance=run.balance,
        cu_seqlens=cu,
        ulysses=run.ulysses,
        output_final_state=final,
    )
    return out, state


def _mamba2(original: Callable[..., Any], run: _Run, hidden_states, dt, A, B, C, *args, **kwargs):
    """``mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit,
    return_final_states)`` through state passing: the state [B, H, head_dim, d_state] decays per head by
    exp(A * dt) at every token."""
    names = ("chunk_size", "D", "dt_bias", "initial_states", "dt_softplus", "dt_limit", "return_final_states")
    kwargs.update(zip(names, args))
    _no_carry(run, "initial_states", kwargs.pop("initial_states", None))
    cu = _cu(run, kwargs)
    final = bool(kwargs.pop("return_final_states", False))
    dt_bias, softplus = kwargs.get("dt_bias"), bool(kwargs.get("dt_softplus", False))
    low, high = kwargs.get("dt_limit", (0.0, float("inf")))

    def kernel(x, dt_, b, c, initial_state=None, output_final_state=False):
        out, state = original(x, dt_, A, b, c, initial_states=initial_state, return_final_states=True, **kwargs)
        return out, state

    def decay(x, dt_, b, c):
        step = dt_ if dt_bias is None else dt_ + dt_bias.to(dt_.dtype)
        step = torch.nn.functional.softplus(step) if softplus else step
        step = torch.clamp(step, min=low, max=high)
        return torch.exp((A.to(step.dtype) * step).sum(dim=1))[..., None, None]

    out, state = state_passing(
        kernel,
        hidden_states,
        dt,
        B,
        C,
        transition=Decay(decay),
        group=run.group,
        balance=run.balance,
        cu_seqlens=cu,
        ulysses=run.ulysses,
        output_final_state=final,
    )
    return (out, state) if final else out


def _selective_scan(original: Callable[..., Any], run: _Run, hidden_states, dt, A, B, C, *args, **kwargs):
    """``mamba_selective_scan(u [b, d, L], dt, A [d, n], B [b, n, L], C, D, z, delta_bias, delta_softplus,
    return_last_state)`` (Mamba, Jamba, Falcon-Mamba) through state passing. The kernel takes no initial
    state, so the entering state's part is added here: ``C_t . (exp(A * sum(dt)) h)`` on the outputs (gated
    by silu(z) like them) and ``exp(A * sum(dt)) h`` on the final state; the state [b, d, n] decays by
    ``exp(A * dt)`` at every token."""
    names = ("D", "z", "delta_bias", "delta_softplus", "return_last_state")
    kwargs.update(zip(names, args))
    cu = _cu(run, kwargs)
    final = bool(kwargs.pop("return_last_state", False))
    bias, softplus = kwargs.get("delta_bias"), bool(kwargs.get("delta_softplus", False))

    def steps(dt_):
        step = dt_ if bias is None else dt_ + bias.to(dt_.dtype)[..., None]
        return torch.nn.functional.softplus(step) if softplus else step

    def kernel(u, dt_, b, c, *gate, initial_state=None, output_final_state=False):
        z = gate[0] if gate else None
        out, state = original(u, dt_, A, b, c, **{**kwargs, "z": z}, return_last_state=True)
        if initial_state is None:
            return out, state
        decay = torch.exp(A[None, :, None, :] * steps(dt_).cumsum(-1)[..., None])  # [b, d, L, n]
        carried = (decay * initial_state[:, :, None, :]).mul(c.transpose(1, 2)[:, None]).sum(-1)
        if z is not None:
            carried = carried * torch.nn.functional.silu(z)
        return out + carried.to(out.dtype), state + decay[:, :, -1] * initial_state

    def decay(u, dt_, b, c, *gate):
        return torch.exp(A[None] * steps(dt_).sum(-1)[..., None])

    z = kwargs.pop("z", None)
    inputs = (hidden_states, dt, B, C) + (() if z is None else (z,))
    out, state = state_passing(
        kernel, *inputs, transition=Decay(decay), group=run.group, balance=run.balance, seq_dim=2,
        cu_seqlens=cu, ulysses=run.ulysses, output_final_state=final,
    )  # fmt: skip
    return (out, state) if final else out


def _conv(original: Callable[..., Any], run: _Run, hidden_states, weight, bias=None, activation=None, **kwargs):
    """``causal_conv1d_fn(x [B, C, L], weight [C, w], bias, activation)`` with its halo (none across a document
    boundary)."""
    cu = _cu(run, kwargs)
    _no_carry(run, "initial_states", kwargs.pop("initial_states", None))

    def conv(x):
        return original(x, weight, bias, activation=activation, **kwargs)

    width = int(weight.shape[-1])
    return causal_conv(
        conv, hidden_states, width, group=run.group, balance=run.balance, cu_seqlens=cu, seq_dim=2, ulysses=run.ulysses
    )


def _unfused(original: Callable[..., Any], run: _Run, *args, **kwargs):
    """A fused whole-layer kernel (``mamba2_split_conv1d_scan_combined``, ``mamba_inner_fn``): None, which
    makes the mixer take its unfused path, whose kernels the other dispatchers serve."""
    return None


KERNELS: dict[str, Callable[..., Any]] = {
    "torch_chunk_gated_delta_rule": _delta,
    "chunk_kimi_delta_attention": _delta,
    "chunk_gated_delta_rule": functools.partial(_delta, _names=_FLA_DELTA),
    "chunk_kda": functools.partial(_delta, _names=_FLA_DELTA),
    "mamba2_chunk_scan": _mamba2,
    "mamba2_split_conv1d_scan_combined": _unfused,
    "mamba_selective_scan": _selective_scan,
    "mamba_inner_fn": _unfused,
    "causal_conv1d_fn": _conv,
}
"""The module-level kernels of transformers' recurrent mixers xcp serves, by name, with the function that
runs each over the context's ranks."""


def _dispatcher(original: Callable[..., Any], cp: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        run = _run()
        if run is None:
            return original(*args, **kwargs)
        return cp(original, run, *args, **kwargs)

    dispatch._xcp_original = original  # type: ignore[attr-defined]
    return dispatch


_install_lock = threading.Lock()


def _install(module_name: str) -> list[str]:
    """Put the dispatchers in place in the modeling module ``module_name`` (once); the names served there."""
    namespace = sys.modules[module_name]
    served = []
    with _install_lock:
        for name, cp in KERNELS.items():
            found = getattr(namespace, name, None)
            if found is None:
                continue
            served.append(name)
            if not hasattr(found, "_xcp_original"):
                setattr(namespace, name, _dispatcher(found, cp))
    return served


def _cp_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A prepared mixer's forward (bound to the instance, so a deep copy of the model binds its own copy):
    its class's forward, whose kernels pass state under a context of more than one rank."""
    forward = type(self).forward
    ctx = current()
    layer = type(self).__name__
    cache = next((a for a in (*args, *kwargs.values()) if type(a).__name__ == "ShardedCache"), None)
    if ctx.world_size == 1 or (cache is not None and not cache.ring):  # one rank, or xcp's generate after the
        out = forward(self, *args, **kwargs)  # prompt: the model's own kernels on the whole states, every rank alike
        if cache is not None:  # xcp's generate cache counts the tokens its recurrent layers have seen
            cache.advance(self.layer_idx, _tokens(layer, args, kwargs))
        return out
    balance = check_recurrent_balance(ctx.balance)
    with _running(_Run(ctx.group, balance, layer, mixer_documents(layer, kwargs), ctx.ulysses)):
        out = forward(self, *args, **kwargs)
    if cache is not None:  # the prompt's ring prefix: the states kept are the whole sequence's (final, last inputs)
        cache.advance(self.layer_idx, _tokens(layer, args, kwargs) * ctx.world_size)
    return out


def _tokens(layer: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The number of tokens a mixer's call runs over (``hidden_states`` ``[B, T, D]``)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(
            f"{layer}: hidden_states: expected [batch, tokens, hidden] as the mixer's first input; got {got}"
        )
    return int(hidden.shape[1])


def _adapt(module: torch.nn.Module) -> None:
    """Bind :func:`_cp_forward` as ``module``'s forward, with the dispatchers in place in its modeling module."""
    if not _install(type(module).__module__):
        raise ValueError(f"{type(module).__name__}: no kernel xcp serves in {type(module).__module__}")
    module.forward = types.MethodType(_cp_forward, module)


LAYERS = (
    "Qwen3NextGatedDeltaNet",
    "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
    "OlmoHybridGatedDeltaNet",
    "LaraMiniGatedDeltaNet",
    "BailingHybridDeltaAttention",
    "KimiLinearDeltaAttention",
    "Mamba2Mixer",
    "BambaMixer",
    "NemotronHMamba2Mixer",
    "ZambaMambaMixer",
    "Zamba2MambaMixer",
    "FalconH1Mixer",
    "GraniteMoeHybridMambaLayer",
    "MambaMixer",
    "JambaMambaMixer",
    "FalconMambaMixer",
    "Lfm2ShortConv",
    "Lfm2MoeShortConv",
    "Lfm3ShortConv",
)
"""The mixer classes (transformers 5.24) whose kernels :data:`KERNELS` serve."""

for _name in LAYERS:
    register_layer(_name, _adapt, name=f"recurrent: {_name}")
