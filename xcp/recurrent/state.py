"""State passing: a recurrent layer's chunk kernel made exact over ranks (the two passes and the scan).

A recurrent layer maps, per head, the state entering a stretch of tokens to the state leaving it affinely:
``F(h) = T h + S``. Pass 1: every rank summarises each of its pieces (``T``, ``S``) with its own kernel;
one all-gather of the summaries; every rank folds its predecessors' summaries into the state entering each
of its pieces (a document boundary starts from zero); pass 2: the kernel again, from that state. The
backward is autograd's through pass 2, the fold and pass 1; the all-gather's backward is an all-to-all of
the summaries' gradients (:mod:`xcp.recurrent.exchange`), so every input and parameter gets its exact
gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..comm import Communicator
from ..comm.dist import resolve_group
from ..lifetime import check_handoff
from ..plugins import select_backend
from ..schedule import DEFAULT_BALANCE, check_world
from .exchange import gather_differentiable, tie
from .layout import Piece, held_pieces, most_pieces

Kernel = Callable[..., tuple[torch.Tensor, Any]]
"""``kernel(*inputs, initial_state=None, output_final_state=False, **kwargs) -> (out, final_state)``: the
convention transformers' and fla's recurrent kernels share; inputs and ``out`` sequence-major at
``seq_dim``."""


Kept = tuple[torch.Tensor, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]
"""A piece's outputs from a zero state, and ``(extra, carry)``: ``carry(h, *extra)`` is what an entering state
``h`` adds to them (``extra``: tensors of pass 1 it reads)."""


class Transition(Protocol):
    """How a family's stretch of tokens acts on the state entering it (``F(h) = T h + S``)."""

    def summarize(
        self, kernel: Kernel, inputs: Sequence[torch.Tensor], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T, S)`` of the stretch ``inputs``: ``S`` the final state from a zero one."""

    def apply(self, t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``T h``."""


def _enter(transition: Transition, t: torch.Tensor, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``T h + S``. A transition whose state is kept in a scaled form (RWKV's numerator and denominator under a
    running maximum) adds its own way: its optional method ``add(th, s)``. One whose sequences start from a
    state other than the sum's zero (xLSTM's running maximum starts at 0, not at minus infinity) says so
    with its optional method ``start(s) -> state`` (``s`` a summary, for the shape): the fold enters the first
    piece from it, as the kernel given no initial state does."""
    th = transition.apply(t, h)
    add = getattr(transition, "add", None)
    return th + s if add is None else add(th, s)


class DeltaRule:
    """Delta-rule kernels (gated delta rule, KDA, DeltaNet): state ``[..., d_k, d_v]``, ``T`` a ``d_k x d_k``
    map per head acting on the state's rows. One kernel call gives both: the state's columns evolve apart,
    so the values ``[v | 0]`` from the state ``[0 | I]`` end at ``[S | T]``.

    :param value: the position of the values among the kernel's inputs.
    """

    def __init__(self, value: int = 2) -> None:
        self.value = value

    def summarize(
        self, kernel: Kernel, inputs: Sequence[torch.Tensor], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, s, *_ = self.summarize_outputs(kernel, inputs, kwargs)
        return t, s

    def summarize_outputs(
        self, kernel: Kernel, inputs: Sequence[torch.Tensor], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]:
        """``(T, S)``, the stretch's outputs from a zero state, and ``extra, carry``: ``carry(h, *extra)`` is
        what an entering state ``h`` adds to them. The probe's outputs give both: ``[o | q^T M]`` for the
        values ``[v | 0]`` from ``[0 | I]``, ``M`` the map from the stretch's start to each token, so the outputs
        from ``h`` are ``o + (q^T M) h`` (inputs and outputs ``[B, T, H, ...]``)."""
        v = inputs[self.value]
        key = inputs[1] if self.value != 1 else inputs[0]
        d_k, d_v = key.shape[-1], v.shape[-1]
        probe = torch.cat((v, v.new_zeros((*v.shape[:-1], d_k))), dim=-1)
        args = list(inputs)
        args[self.value] = probe
        heads = v.shape[-2]
        dtype = torch.promote_types(v.dtype, torch.float32)  # the kernels keep states in float32 at least
        eye = torch.eye(d_k, dtype=dtype, device=v.device).expand(v.shape[0], heads, d_k, d_k)
        start = torch.cat((eye.new_zeros((v.shape[0], heads, d_k, d_v)), eye), dim=-1)
        out, final = kernel(*args, initial_state=start, output_final_state=True, **kwargs)
        return final[..., d_v:], final[..., :d_v], out[..., :d_v], (out[..., d_v:],), _carry_map

    def apply(self, t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return t.to(h.dtype) @ h


class Decay:
    """Diagonal or scalar decays (Mamba, Mamba2, lightning attention, GLA, RG-LRU, RWKV): ``T`` is the product
    of the stretch's decays, in its natural shape (``[B, H, 1, 1]`` for a scalar decay per head), broadcast
    against the state where applied: the exchange carries ``T`` at that size, not the state's.

    :param decay: ``decay(*inputs, **kwargs) -> T`` for a stretch.
    :param carry: optional ``carry(h, *inputs, **kwargs) -> what an entering state h adds to the stretch's
        outputs`` (outputs are linear in it): where given, pass 2 of a piece is pass 1's outputs plus this,
        not a second kernel call.
    """

    def __init__(self, decay: Callable[..., torch.Tensor], carry: Callable[..., torch.Tensor] | None = None) -> None:
        self.decay, self.carry = decay, carry

    def summarize(
        self, kernel: Kernel, inputs: Sequence[torch.Tensor], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, s, _ = self._run(kernel, inputs, kwargs)
        return t, s

    def summarize_outputs(
        self, kernel: Kernel, inputs: Sequence[torch.Tensor], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]] | None:
        """As :meth:`DeltaRule.summarize_outputs`, where a ``carry`` was given (else None)."""
        carry = self.carry
        if carry is None:
            return None
        t, s, out = self._run(kernel, inputs, kwargs)
        return t, s, out, (), lambda h: carry(h, *inputs, **kwargs)

    def _run(
        self, kernel: Kernel, inputs: Sequence[torch.Tensor], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, final = kernel(*inputs, initial_state=None, output_final_state=True, **kwargs)
        t = self.decay(*inputs, **kwargs).to(final.dtype)
        if not _broadcasts(t.shape, final.shape):
            raise ValueError(
                f"decay: expected T broadcastable to the state's shape {tuple(final.shape)}; got {tuple(t.shape)}"
            )
        return t, final, out  # T sent in its own shape (per head or per channel), not expanded to the state's

    def apply(self, t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return t.to(h.dtype) * h


def _carry_map(h: torch.Tensor, mapped: torch.Tensor) -> torch.Tensor:
    """``(q^T M) h`` per token and head (``mapped`` [B, T, H, K], h [B, H, K, V]): one matmul per head."""
    return torch.einsum("bthk,bhkv->bthv", mapped.to(h.dtype), h)


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def state_passing(
    kernel: Kernel,
    *inputs: torch.Tensor,
    transition: Transition,
    group: Any = None,
    balance: str = DEFAULT_BALANCE,
    cu_seqlens: Sequence[int] | None = None,
    seq_dim: int = 1,
    output_final_state: bool = False,
    device: str | None = None,
    handoff: str | None = None,
    ulysses: int = 1,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a recurrent layer's chunk ``kernel`` over a sequence sharded by ``balance``, exactly.

    :param inputs: this rank's shard of every per-token input, sequence-major at ``seq_dim``; ``kwargs``
        (parameters, flags) go to every kernel call unchanged.
    :param transition: how a stretch acts on the state (:class:`DeltaRule`, :class:`Decay`, or a family's
        own :class:`Transition`).
    :param cu_seqlens: the documents' global boundaries: the state starts from zero at each.
    :param output_final_state: also return the state after the last token of the sequence, on every rank.
    :param device: the backend whose streams the exchange runs on (as :func:`xcp.attention`'s; default the
        tensors' device type).
    :param handoff: the hand-off policy of the summaries sent (docs/lifetime.md rule 3; default the backend's).
    :param ulysses: the tokens are placed as ``xcp.shard(..., ulysses=U)`` places them (the layout of a hybrid
        all-to-all + ring context): the state passes along the pieces of that placement over the whole group.
    :returns: ``(out, final_state)``: this rank's outputs (sequence-major at ``seq_dim``) and the final
        state or None.
    """
    passes = prepare_passes(
        kernel, *inputs, transition=transition, group=group, balance=balance, cu_seqlens=cu_seqlens,
        seq_dim=seq_dim, output_final_state=output_final_state, ulysses=ulysses, **kwargs,
    )  # fmt: skip
    backend = select_backend(device, inputs[0].device.type)
    if handoff is not None:
        check_handoff(handoff)
    summaries = passes.summaries()
    gathered = None
    if passes.comm.size() > 1:
        gathered = gather_differentiable(passes.comm, backend, handoff, passes.packed(summaries), passes.rows, "state")
    incoming, final = passes.fold(summaries, gathered)
    out = passes.outputs(incoming)
    return (out if gathered is None else tie(out, gathered)), final


@dataclass
class Passes:
    """State passing on one rank, step by step: :func:`state_passing` is ``summaries`` (pass 1), one
    all-gather of ``packed`` (``rows`` per rank), ``fold`` and ``outputs`` (pass 2). Separate for callers
    that run the exchange themselves (``xcp bench --recurrent`` on one GPU, whose virtual ranks cannot run
    the exchange's backward inside autograd)."""

    comm: Communicator
    kernel: Kernel
    inputs: Sequence[torch.Tensor]
    transition: Transition
    kwargs: dict[str, Any]
    pieces: Sequence[Piece]
    mine: Sequence[Piece]
    seq_dim: int
    output_final_state: bool
    kept: list[Kept | None] = field(default_factory=list)
    """Pass 1's outputs (from a zero state) and ``carry`` of each piece where the transition gives them."""

    @property
    def rows(self) -> int:
        """The summaries every rank sends (padded to the most pieces a rank holds)."""
        return most_pieces(self.pieces, self.comm.size())

    def summaries(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Pass 1 (see :func:`_summaries`)."""
        found, self.kept = _summaries(
            self.kernel, self.inputs, self.transition, self.kwargs, self.pieces, self.mine, self.seq_dim,
            self.output_final_state, self.comm.size(),
        )  # fmt: skip
        return found

    def packed(self, summaries: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> list[torch.Tensor]:
        """The rows this rank sends: each summary flat (``T`` then ``S``), zeros for one left out."""
        t0, s0 = next(x for x in summaries if x is not None)
        return [s0.new_zeros(t0.numel() + s0.numel()) if x is None else _pack(x, s0.dtype) for x in summaries]

    def fold(
        self, summaries: Sequence[tuple[torch.Tensor, torch.Tensor] | None], gathered: torch.Tensor | None
    ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """The state entering each of this rank's pieces (None: zero) and the final state if asked."""
        return _fold(self.comm.rank(), self.transition, self.pieces, summaries, gathered, self.output_final_state)

    def outputs(self, incoming: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Pass 2: the kernel on each piece (segment by segment across documents) from its entering state, or
        pass 1's outputs plus what the entering state adds where pass 1 kept them."""
        outs = []
        kept = self.kept or [None] * len(self.mine)
        for piece, h, done in zip(self.mine, incoming, kept):
            if done is not None:
                zero, extra, carry = done
                outs.append(zero if h is None else (carry(h, *extra) + zero.to(h.dtype)).to(zero.dtype))
                continue
            for i, segment in enumerate(piece.segments):
                args, state = _cut(self.inputs, piece, segment, self.seq_dim), h if i == 0 else None
                out, _ = self.kernel(*args, initial_state=state, output_final_state=False, **self.kwargs)
                outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=self.seq_dim)


def prepare_passes(
    kernel: Kernel,
    *inputs: torch.Tensor,
    transition: Transition,
    group: Any = None,
    balance: str = DEFAULT_BALANCE,
    cu_seqlens: Sequence[int] | None = None,
    seq_dim: int = 1,
    output_final_state: bool = False,
    ulysses: int = 1,
    **kwargs: Any,
) -> Passes:
    """The arguments of :func:`state_passing` checked, and this rank's :class:`Passes`."""
    if "initial_state" in kwargs:
        raise ValueError(
            "initial_state: expected none (state passing starts every document from a zero state); got "
            f"{type(kwargs['initial_state']).__name__}"
        )
    if not inputs:
        raise ValueError("inputs: expected at least one per-token tensor; got none")
    if cu_seqlens is not None and getattr(transition, "start", None) is not None:
        raise ValueError(
            "cu_seqlens: expected None with a transition whose sequences start from a state of their own "
            f"({type(transition).__name__}.start): a document boundary inside a piece would start from zero"
        )
    comm = resolve_group(group)
    size, rank = comm.size(), comm.rank()
    check_world(size, rank)
    length = _local_length(inputs, seq_dim)
    pieces, mine = held_pieces("inputs", length, seq_dim, size, rank, balance, cu_seqlens, ulysses)
    return Passes(comm, kernel, inputs, transition, kwargs, pieces, mine, seq_dim, output_final_state)


def _summaries(
    kernel: Kernel,
    inputs: Sequence[torch.Tensor],
    transition: Transition,
    kwargs: dict[str, Any],
    pieces: Sequence[Piece],
    mine: Sequence[Piece],
    seq_dim: int,
    output_final_state: bool,
    world_size: int,
) -> tuple[
    list[tuple[torch.Tensor, torch.Tensor] | None],
    list[Kept | None],
]:
    """Pass 1: the ``(T, S)`` of each of this rank's pieces, None for the last piece of the global order
    unless the final state is asked (nothing after it uses its summary); and, where the transition gives
    them (``summarize_outputs``) for a piece of one segment, its outputs from a zero state with ``carry(h)``,
    so that pass 2 needs no kernel call there. A rank holding only that piece
    learns the summaries' shapes from a one-token stretch (its row of the exchange is zeros); in a world of
    one nothing is exchanged."""
    last = pieces[-1]
    needed = [output_final_state or (p.start, p.stop) != (last.start, last.stop) for p in mine]
    rich = getattr(transition, "summarize_outputs", None)
    found: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    kept: list[Kept | None] = []
    for p, need in zip(mine, needed):
        args = _cut(inputs, p, p.segments[-1], seq_dim)
        both = rich(kernel, args, kwargs) if need and rich is not None and len(p.segments) == 1 else None
        if both is not None:  # pass 1's outputs serve pass 2 too (a piece of one segment)
            found.append(both[:2])
            kept.append(both[2:])
            continue
        found.append(transition.summarize(kernel, args, kwargs) if need else None)
        kept.append(None)
    if not any(needed) and world_size > 1:
        p = mine[0]
        with torch.no_grad():
            t, s = transition.summarize(kernel, _cut(inputs, p, (p.stop - 1, p.stop), seq_dim), kwargs)
        # the zeros join the graph where the other ranks' summaries do, so this rank runs the exchange's backward
        grad = torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in (*inputs, *kwargs.values())
        )
        found[0] = (torch.zeros_like(t), torch.zeros_like(s).requires_grad_(grad))
    return found, kept


def _local_length(inputs: Sequence[torch.Tensor], seq_dim: int) -> int:
    lengths = {x.shape[seq_dim] for x in inputs}
    if len(lengths) != 1:
        shapes = [tuple(x.shape) for x in inputs]
        raise ValueError(f"inputs: expected the same length at dim {seq_dim} in every input; got shapes {shapes}")
    return lengths.pop()


def _cut(inputs: Sequence[torch.Tensor], piece: Piece, segment: tuple[int, int], seq_dim: int) -> list[torch.Tensor]:
    """The inputs of ``segment`` (global positions) of ``piece``, from this rank's shard."""
    a = piece.local + segment[0] - piece.start
    return [x.narrow(seq_dim, a, segment[1] - segment[0]) for x in inputs]


def _fold(
    rank: int,
    transition: Transition,
    pieces: Sequence[Piece],
    summaries: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
    gathered: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """The state entering each of this rank's pieces (None: zero) and the final state if asked, from its
    own summaries and the ``gathered`` ones (``[P, rows, numel]``; None in a world of one)."""
    t0, s0 = next((x for x in summaries if x is not None), (None, None))
    last = len(pieces) if output_final_state else max(i for i, p in enumerate(pieces) if p.owner == rank) + 1
    incoming: list[torch.Tensor | None] = []
    h: torch.Tensor | None = None
    start = getattr(transition, "start", None)
    for i, piece in enumerate(pieces[:last]):
        entering = h if piece.carries_in else None
        if piece.owner == rank:
            incoming.append(entering)
        if i == last - 1 and not output_final_state:
            break  # the state leaving this rank's last piece is nobody's business here
        if piece.owner == rank:
            found = summaries[piece.index]
            assert found is not None
            t, s = found
        else:
            assert gathered is not None and t0 is not None and s0 is not None
            row = gathered[piece.owner, piece.index]
            t, s = row[: t0.numel()].view(t0.shape), row[t0.numel() :].view(s0.shape)
        if entering is None and start is not None:  # the sequence's start (pass 2's kernel starts there itself)
            entering = start(s)
        h = s if entering is None or piece.resets else _enter(transition, t, entering, s)
    return incoming, (h if output_final_state else None)


def _pack(summary: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    t, s = summary
    return torch.cat((t.reshape(-1).to(dtype), s.reshape(-1)))
