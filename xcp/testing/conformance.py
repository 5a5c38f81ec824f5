"""The backend conformance suite: what every backend must do for the ring to be correct on its device.

Each check is a plain function of a :class:`xcp.Backend` that raises AssertionError with a message
naming what differs; :func:`cases` lists them for one backend (every dtype and mask it claims), so any
test runner can drive them. With pytest::

    python -m xcp.testing --xcp-backend NAME
    pytest -p xcp.testing.pytest_plugin --pyargs xcp.testing --xcp-backend NAME

Numbers are compared with :mod:`xcp.testing.reference` (float64, on the CPU) on seeded random inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..api import shard, unshard
from ..backends.base import Backend, check_backend
from ..comm import LocalWorld
from ..kernels.math import Alibi
from ..kernels.merge import accumulator_dtype, new_accumulators
from ..lifetime import HANDOFF_POLICIES, hand_off
from ..ring import RingConfig, merge_block, ring_backward, ring_forward
from .reference import allowed_pairs, reference_attention, reference_gradients

TOLERANCES: dict[torch.dtype, float] = {
    # Largest error allowed, relative to max(1, max |reference|), by input dtype. Shapes are small (at
    # most 24 keys, head_dim 16), so a correct kernel's error is a few units of its dtype's rounding;
    # a wrong mask, scale, head mapping or lse gives errors of 1e-1 or more. Measured on an H200 with
    # torch's flash kernel (these shapes and S=200, five seeds): worst 5.8e-3 in bfloat16, 9.4e-4 in
    # float16, over out, lse, dq, dk and dv.
    torch.float64: 1e-10,  # eps 1.1e-16: anything above 1e-10 means a float32 step inside
    torch.float32: 1e-4,  # eps 1.2e-7; room for fused exp and reordered sums, none for a TF32-only kernel
    torch.float16: 5e-3,  # eps 9.8e-4: five roundings, 5x the flash kernel's worst
    torch.bfloat16: 2e-2,  # eps 7.8e-3: between two and three roundings, 3.5x the flash kernel's worst
}

HEADS = {"mha": (4, 4), "gqa": (4, 2)}
"""(query heads, KV heads). In ``gqa`` the mapping matters: head h must use KV head h // 2, not h % 2."""

BATCH, HEAD_DIM, SEQ = 2, 16, 21  # odd lengths catch kernels that assume whole tiles
SCALE = 0.37  # not 1/sqrt(16): catches a kernel that ignores its ``scale`` argument
RING_SEQ = 24  # divisible by 2P for P = 2, 3 (zigzag) and by P (stripe, contiguous)
VARLEN_LAYOUTS = {  # name: (cu_q, cu_k, causal) of packed segments; segments of length 1, odd totals
    "causal": ((0, 1, 8, 9, SEQ), (0, 1, 8, 9, SEQ), True),
    "full": ((0, 1, 8, 9, SEQ), (0, 5, 6, 14, 17), False),
}
FILLER_LAYOUTS = {  # filler segments (no keys, or no queries), checked where a backend has varlen_fillers
    "fillers": ((0, 3, 3, 8, 9, SEQ), (0, 0, 4, 9, 9, 14), False),
    "causal-fillers": ((0, 2, 2, 7, SEQ), (0, 0, 3, 8, 8 + SEQ - 7), True),
}
VARLEN_SPLIT = ((0, 1, 8, 9, SEQ), (0, 4, 6, 14, 17))
"""Segments whose keys (each at least 2) the ``varlen-split-keys`` check cuts into two varlen calls."""
VALUE_DIMS = (8, 24)
"""Value head dims of the ``*-dv*`` checks beside q/k's HEAD_DIM (as DeepSeek-V3's 128 beside 192, and the
other way round): out and dv take v's head dim."""
PAGED_BLOCK = 256
"""Rows of a block of the ``paged-*`` checks' pools: a multiple of 256, which FlashAttention-2's paged form
requires (a backend whose kernel takes other sizes is checked at this one all the same)."""
PAGED_SEGMENTS = (  # (queries, key rows, blocks of the table): a decode row, an empty segment, a chunk over 3 blocks
    (1, 300, (3, 0)),
    (2, 0, ()),
    (5, 700, (1, 4, 2)),
)
"""The segments of the ``paged-*`` checks over a pool of 6 blocks (block 5 never listed: random tokens a kernel
must not read); table entries past a segment's blocks hold block 5."""
PAGED_DECODE_BLOCK = 16
"""Rows of a block of the ``paged-*-decode`` check's pool: PagedKVCache's default block size."""
PAGED_DECODE_SEGMENTS = (  # one query per segment (max_q 1), one without a query, one without keys
    (1, 40, (2, 0, 4)),
    (0, 7, (1,)),
    (1, 0, ()),
    (1, 33, (5, 3, 6)),
)
"""The segments of the ``paged-*-decode`` check (a decode step's call) over a pool of 8 blocks of 16 rows (block 7
never listed), lengths not multiples of the block, tables out of order."""
PAGED_LAYOUTS = {"chunk": (PAGED_BLOCK, 6, PAGED_SEGMENTS), "decode": (PAGED_DECODE_BLOCK, 8, PAGED_DECODE_SEGMENTS)}
"""The ``paged-*`` checks' pools: (rows of a block, blocks, segments)."""

RANGE_ROOM = 13
"""Rows of the KV storage the ``range-*`` checks give ``forward_range``; those outside the range hold
random (finite) tokens, which a kernel that reads past the range's ends mixes in."""
RANGE_CASES = {  # name: (queries T, lo, hi)
    "decode": (1, 0, 9),
    "inner": (3, 4, 11),
    "full": (2, 0, RANGE_ROOM),
    "empty": (2, 6, 6),
}
RING_LAYOUTS = (  # (causal, balance, masks the backend must serve)
    (False, "contiguous", ("none",)),
    (True, "zigzag", ("none", "causal")),
    (True, "stripe", ("causal",)),  # the ring runs its strict blocks as causal calls on shifted views
)


@dataclass(frozen=True)
class Case:
    """One named check: ``run(backend)`` raises AssertionError when the backend does not conform."""

    id: str
    check: Callable[..., None]
    kwargs: tuple[tuple[str, Any], ...] = ()

    def run(self, backend: Backend) -> None:
        self.check(backend, **dict(self.kwargs))

    def __str__(self) -> str:
        return self.id


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- helpers


def _device(backend: Backend) -> torch.device:
    return torch.device(backend.device_type)


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def _sequence_view(
    b: int, s: int, h: int, dtype: torch.dtype, device: torch.device, seed: int, dim: int = HEAD_DIM
) -> torch.Tensor:
    """A [b, s, h, dim] tensor that is a slice along the sequence of a longer one (strided when b > 1),
    which is what the ring hands a kernel."""
    return _random((b, s + 3, h, dim), dtype, device, seed)[:, 2 : 2 + s]


def _block_inputs(backend: Backend, dtype: torch.dtype, heads: str, sq: int, sk: int, seed: int, value_dim: int):
    h, hkv = HEADS[heads]
    dev = _device(backend)
    q = _sequence_view(BATCH, sq, h, dtype, dev, seed)
    k = _sequence_view(BATCH, sk, hkv, dtype, dev, seed + 1)
    v = _sequence_view(BATCH, sk, hkv, dtype, dev, seed + 2, value_dim)
    dout = _sequence_view(BATCH, sq, h, dtype, dev, seed + 3, value_dim)
    return q, k, v, dout


def assert_close(what: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise AssertionError unless ``actual`` matches the float64 ``expected`` within the tolerance of
    ``dtype``; -inf must match -inf exactly and NaN is never accepted."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}; got {tuple(actual.shape)}")
    got = actual.detach().to("cpu", torch.float64)
    if torch.isnan(got).any():
        raise AssertionError(f"{what}: {int(torch.isnan(got).sum())} NaN values (expected none)")
    inf_expected, inf_got = torch.isneginf(expected), torch.isneginf(got)
    if not torch.equal(inf_expected, inf_got):
        where = (inf_expected != inf_got).nonzero()[0].tolist()
        raise AssertionError(f"{what}: -inf pattern differs from the reference, first at index {where}")
    finite = ~inf_expected
    if not finite.any():
        return
    err = (got[finite] - expected[finite]).abs()
    bound = TOLERANCES[dtype] * max(1.0, expected[finite].abs().max().item())
    worst = err.max().item()
    if not worst <= bound:
        index = finite.nonzero()[err.argmax()].tolist()
        raise AssertionError(
            f"{what}: max abs error {worst:.3g} at index {index} exceeds {bound:.3g} "
            f"({TOLERANCES[dtype]:g} x max(1, max|ref|) for {_dtype_name(dtype)})"
        )


def _assert_result(what: str, x: Any, like: torch.Tensor, shape: tuple[int, ...], dtypes: tuple) -> None:
    if not isinstance(x, torch.Tensor):
        raise AssertionError(f"{what}: expected a torch.Tensor; got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise AssertionError(f"{what}: expected shape {tuple(shape)}; got {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise AssertionError(f"{what}: expected dtype {' or '.join(map(str, dtypes))}; got {x.dtype}")
    if x.device.type != like.device.type:
        raise AssertionError(f"{what}: expected a {like.device.type} tensor; got one on {x.device}")


def _assert_unchanged(what: str, before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    for i, (b, a) in enumerate(zip(before, after)):
        if not torch.equal(b, a):
            raise AssertionError(f"{what}: input {i} was modified in place (inputs must never be mutated)")


def _value_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """Outputs and gradients may come in the input dtype or the accumulator dtype."""
    return tuple(dict.fromkeys((dtype, accumulator_dtype(dtype))))


# ---------------------------------------------------------------------------------------------- identity


def check_identity(backend: Backend) -> None:
    """Identity attributes are well formed and the backend says it is available."""
    try:
        check_backend(backend)
    except (TypeError, ValueError) as exc:
        raise AssertionError(str(exc)) from None
    answer = backend.available()
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool)):
        raise AssertionError(f"available(): expected a (bool, str) tuple; got {answer!r}")
    if not answer[0]:
        raise AssertionError(f"available(): the backend under test says it is unusable here: {answer[1]}")


def check_registered(backend: Backend) -> None:
    """``xcp.get_backend(name)`` finds a backend of the same class (it was registered through the hook)."""
    from ..plugins import get_backend

    found = get_backend(backend.name)
    if type(found) is not type(backend):
        raise AssertionError(
            f"get_backend({backend.name!r}) returned a {type(found).__name__}; expected a {type(backend).__name__}"
        )


# ---------------------------------------------------------------------------------------------- streams


def check_streams(backend: Backend) -> None:
    """``stream_context(s)`` makes ``s`` current and restores the caller's stream afterwards;
    ``is_capturing()`` is False outside graph capture."""
    dev = _device(backend)
    caller = backend.current_stream(dev)
    side = backend.new_stream(dev)
    if caller is None or side is None:
        raise AssertionError(f"current_stream / new_stream returned {caller!r} / {side!r}; expected streams")
    with backend.stream_context(side):
        inside = backend.current_stream(dev)
        if inside != side:
            raise AssertionError(f"inside stream_context(s) the current stream is {inside!r}; expected {side!r}")
    after = backend.current_stream(dev)
    if after != caller:
        raise AssertionError(f"after stream_context the current stream is {after!r}; expected {caller!r}")
    capturing = backend.is_capturing()
    if capturing is not False:
        raise AssertionError(f"is_capturing() outside capture returned {capturing!r}; expected False")


def check_events(backend: Backend) -> None:
    """Work ordered by record_event / wait_event / wait_stream sees the producer's result; the methods
    return None."""
    dev = _device(backend)
    loose: Any = backend  # the contract says None; what a backend really returns is what is checked
    caller = backend.current_stream(dev)
    producer, consumer = backend.new_stream(dev), backend.new_stream(dev)
    base = torch.full((256, 256), 1.0 / 256, device=dev)
    results = {"wait_stream": loose.wait_stream(producer, caller)}
    with backend.stream_context(producer):
        x = base
        for _ in range(8):  # enough work that a consumer which does not wait would read too early
            x = x @ base
        x = x.sum() * 0 + 7.0
    event = backend.new_event()
    results["record_event"] = loose.record_event(event, producer)
    results["wait_event"] = loose.wait_event(consumer, event)
    with backend.stream_context(consumer):
        y = x * 2
    done = backend.new_event()
    backend.record_event(done, consumer)
    results["synchronize_event"] = loose.synchronize_event(done)
    backend.wait_stream(caller, consumer)
    for name, value in results.items():
        if value is not None:
            raise AssertionError(f"{name}(...) returned {value!r}; expected None")
    got = y.item()
    if got != 14.0:
        raise AssertionError(f"a consumer that waited on the producer's event read {got}; expected 14.0")


def check_handoff(backend: Backend, policy: str) -> None:
    """``handoff(t, stream, policy)`` returns a tensor equal to ``t``: the same memory for
    ``record_stream``, ``event`` and ``none``, a copy for ``clone``; ``t`` is never changed."""
    dev = _device(backend)
    t = torch.arange(24, dtype=torch.float32, device=dev).reshape(4, 6)
    before = t.clone()
    consumer = backend.new_stream(dev)
    got = hand_off(backend, t, consumer, policy)
    backend.synchronize(dev)
    _assert_result(f"handoff(policy={policy!r})", got, t, tuple(t.shape), (t.dtype,))
    if not torch.equal(got, before):
        raise AssertionError(f"handoff(policy={policy!r}) returned different values")
    aliases = got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    if policy == "clone":
        if aliases:
            raise AssertionError("handoff(policy='clone') returned a tensor sharing memory with its input")
        got.add_(1)
        backend.synchronize(dev)
    elif not aliases:
        raise AssertionError(f"handoff(policy={policy!r}) copied the tensor; expected the same memory (zero copy)")
    _assert_unchanged(f"handoff(policy={policy!r})", [before], [t])


def check_handoff_default(backend: Backend) -> None:
    """Without a policy, ``handoff`` applies ``backend.handoff_policy``; an unknown policy is a ValueError."""
    dev = _device(backend)
    t = torch.ones(8, device=dev)
    got = hand_off(backend, t, backend.new_stream(dev), backend.handoff_policy)
    aliases = got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    if aliases == (backend.handoff_policy == "clone"):
        raise AssertionError(
            f"handoff without a policy {'shared' if aliases else 'copied'} the tensor; "
            f"the default policy {backend.handoff_policy!r} says otherwise"
        )
    try:
        hand_off(backend, t, backend.new_stream(dev), "teleport")
    except ValueError:
        return
    raise AssertionError("handoff(policy='teleport') did not raise ValueError")


def _memory_stats(backend: Backend, dev: torch.device) -> dict[str, int]:
    """``memory_stats`` of a backend that has counted before: counts again, never None."""
    stats = backend.memory_stats(dev)
    if stats is None:
        raise AssertionError("memory_stats() returned None after returning counts; expected counts every time")
    return stats


def check_memory_stats(backend: Backend) -> None:
    """``memory_stats`` is None or counts bytes: it grows by at least a new tensor's size, and
    ``reset_peak_memory`` brings the peak back down to what is allocated now."""
    dev = _device(backend)
    backend.synchronize(dev)
    first = backend.memory_stats(dev)
    if first is None:
        backend.reset_peak_memory(dev)  # must be callable all the same
        return
    for key in ("allocated", "peak"):
        if not isinstance(first.get(key), int):
            raise AssertionError(f"memory_stats()[{key!r}]: expected an int; got {first.get(key)!r}")
    size = 4 << 20
    x = torch.empty(size, dtype=torch.uint8, device=dev)
    held = _memory_stats(backend, dev)
    if held["allocated"] - first["allocated"] < size:
        raise AssertionError(
            f"memory_stats: allocating {size} bytes raised 'allocated' by {held['allocated'] - first['allocated']}"
        )
    if held["peak"] < held["allocated"]:
        raise AssertionError(f"memory_stats: peak {held['peak']} < allocated {held['allocated']}")
    del x
    backend.synchronize(dev)
    backend.reset_peak_memory(dev)
    after = _memory_stats(backend, dev)
    if after["peak"] >= held["allocated"]:
        raise AssertionError(
            f"memory_stats: after freeing {size} bytes and reset_peak_memory the peak is {after['peak']}, "
            f"not below the {held['allocated']} allocated before"
        )


# ---------------------------------------------------------------------------------------------- kernel


def _forward_checked(backend, q, k, v, mask, dtype):
    out, lse = backend.forward(q, k, v, mask, SCALE)
    b, sq, h, _ = q.shape
    _assert_result("forward out", out, q, (b, sq, h, v.shape[3]), _value_dtypes(dtype))
    _assert_result("forward lse", lse, q, (b, h, sq), (accumulator_dtype(dtype),))
    return out, lse


LOG2_E = math.log2(math.e)
"""A base-2 log-sum-exp (what kernels that exponentiate with exp2 keep) is this many times the natural one."""


def assert_natural_log(what: str, lse: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """Raise when ``lse`` is the base-2 log-sum-exp of the scores (``LOG2_E`` x the natural-log ``ref_lse``)
    rather than the natural-log one: partials merged across ranks or blocks (``exp(L_r - L)``) need
    natural logs, and a base-2 lse silently weighs them wrong (a bug public decode systems have shipped)."""
    seen = torch.isfinite(ref_lse)
    got, want = lse.detach().double().cpu()[seen.cpu()], ref_lse.detach().double().cpu()[seen.cpu()]
    if got.numel() == 0 or torch.allclose(got, want, rtol=1e-2, atol=1e-2):
        return
    if torch.allclose(got, want * LOG2_E, rtol=1e-2, atol=1e-2):
        raise AssertionError(
            f"{what}: expected the natural-log log-sum-exp, ln(sum exp(scale * q.k)); got the base-2 one "
            f"({LOG2_E:.4f} x the natural one), which a log-sum-exp merge weighs wrongly"
        )


def check_forward(
    backend: Backend, dtype: torch.dtype, mask: str, heads: str, sq: int = SEQ, sk: int = SEQ, value_dim: int = HEAD_DIM
) -> None:
    """Block forward against the reference: out (in v's head dim, ``value_dim``), and lse = logsumexp of the
    scaled scores in float32 [B, H, Sq] (float64 for float64), -inf with an all-zero output on rows that see
    no key."""
    q, k, v, _ = _block_inputs(backend, dtype, heads, sq, sk, 11, value_dim)
    inputs = [x.clone() for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(q, k, v, mask, SCALE)
    out, lse = _forward_checked(backend, q, k, v, mask, dtype)
    assert_close("forward out", out, ref_out, dtype)
    assert_natural_log("forward lse", lse, ref_lse)
    assert_close("forward lse", lse, ref_lse, dtype)
    blind = ~allowed_pairs(sq, sk, mask).any(dim=1)
    if blind.any() and out[:, blind.to(out.device)].count_nonzero() > 0:
        raise AssertionError("forward out: rows that see no key must be exactly zero")
    _assert_unchanged("forward", inputs, [q, k, v])


def _check_gradients(
    names: tuple[str, str, str], grads: Any, qkv: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...], dtype
) -> None:
    """``grads`` returned by a backward call is (dq, dk, dv), each shaped like its input in a value dtype and
    close to its reference. ``names``: the call, the messages' prefix and a suffix for the closeness."""
    call, prefix, suffix = names
    if not (isinstance(grads, tuple | list) and len(grads) == 3):
        raise AssertionError(f"{call}: expected (dq, dk, dv); got {type(grads).__name__}")
    for name, g, x, ref in zip(("dq", "dk", "dv"), grads, qkv, refs):
        _assert_result(f"{prefix} {name}", g, x, tuple(x.shape), _value_dtypes(dtype))
        assert_close(f"{prefix} {name}{suffix}", g, ref, dtype)


def check_backward(
    backend: Backend, dtype: torch.dtype, mask: str, heads: str, sq: int = SEQ, sk: int = SEQ, value_dim: int = HEAD_DIM
) -> None:
    """Block backward against the reference, given the reference out (in the input dtype) and lse."""
    q, k, v, dout = _block_inputs(backend, dtype, heads, sq, sk, 23, value_dim)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference_gradients(dout, q, k, v, mask, SCALE)
    out = ref_out.to(q.device, dtype)
    lse = ref_lse.to(q.device, accumulator_dtype(dtype))
    inputs = [x.clone() for x in (dout, q, k, v, out, lse)]
    grads = backend.backward(dout, q, k, v, out, lse, mask, SCALE)
    _check_gradients(("backward", "backward", ""), grads, (q, k, v), (ref_dq, ref_dk, ref_dv), dtype)
    _assert_unchanged("backward", inputs, [dout, q, k, v, out, lse])


def _check_merged_parts(
    names: tuple[str, str],
    backend: Backend,
    dtype: torch.dtype,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    refs: tuple[torch.Tensor, ...],
    parts: list[tuple[Any, Any]],
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    backward: Callable[..., Any],
) -> None:
    """What the ring relies on, for one kind of kernel call: blocks over ``parts`` of the keys (``(keys, arg)``:
    the key rows and the call's own argument) merged with ``merge_`` equal attention over all keys, and
    backward blocks given the *merged* out and lse sum to the full gradients. ``forward(q, k, v, arg)`` and
    ``backward(dout, q, k, v, out, lse, arg)`` make one call; ``names`` prefix the forward and backward
    messages."""
    q, k, v, dout = inputs
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = refs
    out, lse = new_accumulators(q)
    for keys, arg in parts:
        block_out, block_lse = forward(q, k[:, keys], v[:, keys], arg)
        merge_block(backend, out, lse, block_out, block_lse)
    assert_close(f"{names[0]} out", out, ref_out, dtype)
    assert_close(f"{names[0]} lse", lse, ref_lse, dtype)
    merged_out = out.to(dtype)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk, dv = torch.zeros(k.shape, dtype=torch.float64), torch.zeros(v.shape, dtype=torch.float64)
    for keys, arg in parts:
        bdq, bdk, bdv = backward(dout, q, k[:, keys], v[:, keys], merged_out, lse, arg)
        rows = keys if isinstance(keys, slice) else keys.cpu()
        dq += bdq.to("cpu", torch.float64)
        dk[:, rows] = bdk.to("cpu", torch.float64)
        dv[:, rows] = bdv.to("cpu", torch.float64)
    assert_close(f"{names[1]} dq", dq, ref_dq, dtype)
    assert_close(f"{names[1]} dk", dk, ref_dk, dtype)
    assert_close(f"{names[1]} dv", dv, ref_dv, dtype)


def check_split_keys(backend: Backend, dtype: torch.dtype) -> None:
    """What the ring relies on: forward blocks over two key ranges merged with ``merge_`` equal attention
    over all keys, and backward blocks given the *merged* out and lse sum to the full gradients."""
    q, k, v, dout = _block_inputs(backend, dtype, "gqa", SEQ, SEQ, 37, HEAD_DIM)
    refs = reference_gradients(dout, q, k, v, "none", SCALE)
    cut = SEQ // 2
    parts: list[tuple[Any, Any]] = [(slice(0, cut), None), (slice(cut, SEQ), None)]
    _check_merged_parts(
        ("merged forward", "split-key backward"), backend, dtype, (q, k, v, dout), refs, parts,
        lambda q, k, v, _: _forward_checked(backend, q, k, v, "none", dtype),
        lambda dout, q, k, v, out, lse, _: backend.backward(dout, q, k, v, out, lse, "none", SCALE),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- varlen


def _packed_inputs(backend: Backend, dtype: torch.dtype, heads: str, tq: int, tk: int, seed: int, value_dim: int):
    """Batch-1 packed (q, k, v, dout) [1, T, H, D]: q and k are strided views (sequence stride D, from a
    heads-first buffer), which the varlen methods must accept like the dense ones."""
    h, hkv = HEADS[heads]
    dev = _device(backend)

    def strided(t: int, n: int, s: int) -> torch.Tensor:
        return _random((1, n, t + 3, HEAD_DIM), dtype, dev, s).transpose(1, 2)[:, 2 : 2 + t]

    q, k = strided(tq, h, seed), strided(tk, hkv, seed + 1)
    v = _sequence_view(1, tk, hkv, dtype, dev, seed + 2, value_dim)
    return q, k, v, _sequence_view(1, tq, h, dtype, dev, seed + 3, value_dim)


def _segments(cu_q: tuple[int, ...], cu_k: tuple[int, ...]) -> list[tuple[slice, slice]]:
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]


def _varlen_reference(dout, q, k, v, cu_q, cu_k, causal: bool):
    """``(out, lse, dq, dk, dv)`` in float64: each segment on its own through the reference, concatenated."""
    parts = [
        reference_gradients(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], "causal" if causal else "none", SCALE)
        for qs, ks in _segments(cu_q, cu_k)
    ]
    out, lse, dq, dk, dv = zip(*parts)
    return torch.cat(out, 1), torch.cat(lse, 2), torch.cat(dq, 1), torch.cat(dk, 1), torch.cat(dv, 1)


def _varlen_forward_checked(backend, q, k, v, cu_q, cu_k, causal, dtype):
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, SCALE)
    _assert_result("varlen forward out", out, q, (*q.shape[:3], v.shape[3]), _value_dtypes(dtype))
    _assert_result("varlen forward lse", lse, q, (1, q.shape[2], q.shape[1]), (accumulator_dtype(dtype),))
    return out, lse


def check_forward_varlen(
    backend: Backend, dtype: torch.dtype, layout: str, heads: str, value_dim: int = HEAD_DIM
) -> None:
    """``forward_varlen`` of packed segments against the reference on each segment alone: out, and lse
    float32 [1, H, Tq] (float64 for float64)."""
    cu_q, cu_k, causal = {**VARLEN_LAYOUTS, **FILLER_LAYOUTS}[layout]
    q, k, v, dout = _packed_inputs(backend, dtype, heads, cu_q[-1], cu_k[-1], 51, value_dim)
    inputs = [x.clone() for x in (q, k, v)]
    ref_out, ref_lse, *_ = _varlen_reference(dout, q, k, v, cu_q, cu_k, causal)
    out, lse = _varlen_forward_checked(backend, q, k, v, cu_q, cu_k, causal, dtype)
    assert_close(f"varlen forward out ({layout})", out, ref_out, dtype)
    assert_close(f"varlen forward lse ({layout})", lse, ref_lse, dtype)
    _assert_unchanged("varlen forward", inputs, [q, k, v])


def check_backward_varlen(
    backend: Backend, dtype: torch.dtype, layout: str, heads: str, value_dim: int = HEAD_DIM
) -> None:
    """``backward_varlen`` against the reference given the reference out (input dtype) and lse, the lse
    a strided slice as the ring passes it."""
    cu_q, cu_k, causal = {**VARLEN_LAYOUTS, **FILLER_LAYOUTS}[layout]
    q, k, v, dout = _packed_inputs(backend, dtype, heads, cu_q[-1], cu_k[-1], 61, value_dim)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _varlen_reference(dout, q, k, v, cu_q, cu_k, causal)
    out = ref_out.to(q.device, dtype)
    lse = torch.cat([ref_lse, ref_lse[:, :, :3]], dim=2).to(q.device, accumulator_dtype(dtype))[:, :, : q.shape[1]]
    inputs = [x.clone() for x in (dout, q, k, v, out, lse)]
    grads = backend.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, causal, SCALE)
    names = ("backward_varlen", "varlen backward", f" ({layout})")
    _check_gradients(names, grads, (q, k, v), (ref_dq, ref_dk, ref_dv), dtype)
    _assert_unchanged("varlen backward", inputs, [dout, q, k, v, out, lse])


def check_split_keys_varlen(backend: Backend, dtype: torch.dtype) -> None:
    """The ring's use of the varlen methods: each segment's keys cut in two varlen calls, merged with
    ``merge_``, and backward calls given the *merged* out and lse, equal each segment over all its keys."""
    cu_q, cu_k = VARLEN_SPLIT
    q, k, v, dout = _packed_inputs(backend, dtype, "gqa", cu_q[-1], cu_k[-1], 71, HEAD_DIM)
    refs = _varlen_reference(dout, q, k, v, cu_q, cu_k, False)
    halves: list[tuple[Any, Any]] = []  # per part: (key rows of k in order, cu_k of the part)
    for first in (True, False):
        rows: list[int] = []
        cu = [0]
        for _, ks in _segments(cu_q, cu_k):
            cut = ks.start + (ks.stop - ks.start + 1) // 2
            part = range(ks.start, cut) if first else range(cut, ks.stop)
            rows.extend(part)
            cu.append(cu[-1] + len(part))
        halves.append((torch.tensor(rows, device=q.device), tuple(cu)))
    _check_merged_parts(
        ("varlen split-key merged", "varlen split-key backward"), backend, dtype, (q, k, v, dout), refs, halves,
        lambda q, k, v, cu: _varlen_forward_checked(backend, q, k, v, cu_q, cu, False, dtype),
        lambda dout, q, k, v, out, lse, cu: backend.backward_varlen(dout, q, k, v, out, lse, cu_q, cu, False, SCALE),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- range


def check_forward_range(backend: Backend, dtype: torch.dtype, ends: str, heads: str, value_dim: int = HEAD_DIM) -> None:
    """``forward_range`` of queries against rows lo..hi-1 of a KV storage, lo and hi int64 tensors of one
    element on the device, against the reference on those rows alone: out, and lse float32 [B, H, T]
    (float64 for float64); an empty range (lo == hi) gives out exactly 0 and lse -inf on every row."""
    t, lo, hi = RANGE_CASES[ends]
    h, hkv = HEADS[heads]
    dev = _device(backend)
    q = _sequence_view(BATCH, t, h, dtype, dev, seed=81)
    k = _random((BATCH, RANGE_ROOM, hkv, HEAD_DIM), dtype, dev, 82)  # a cache's storage: contiguous
    v = _random((BATCH, RANGE_ROOM, hkv, value_dim), dtype, dev, 83)
    lo_t, hi_t = (torch.tensor([end], dtype=torch.int64, device=dev) for end in (lo, hi))
    inputs = [x.clone() for x in (q, k, v, lo_t, hi_t)]
    ref_out, ref_lse = reference_attention(q, k[:, lo:hi], v[:, lo:hi], "none", SCALE)
    out, lse = backend.forward_range(q, k, v, lo_t, hi_t, SCALE)
    _assert_result("range forward out", out, q, (*q.shape[:3], value_dim), _value_dtypes(dtype))
    _assert_result("range forward lse", lse, q, (BATCH, h, t), (accumulator_dtype(dtype),))
    assert_close(f"range forward out ({ends}: key rows [{lo}, {hi}))", out, ref_out, dtype)
    assert_natural_log("range forward lse", lse, ref_lse)
    assert_close(f"range forward lse ({ends}: key rows [{lo}, {hi}))", lse, ref_lse, dtype)
    if lo == hi and out.count_nonzero() > 0:
        raise AssertionError("range forward out: an empty range (lo == hi) must give an all-zero output")
    _assert_unchanged("range forward", inputs, [q, k, v, lo_t, hi_t])


# ---------------------------------------------------------------------------------------------- paged


def check_forward_paged(backend: Backend, dtype: torch.dtype, causal: bool, heads: str, layout: str = "chunk") -> None:
    """``forward_paged`` of packed queries of a layout of :data:`PAGED_LAYOUTS` (``chunk``: :data:`PAGED_SEGMENTS`;
    ``decode``: :data:`PAGED_DECODE_SEGMENTS`, one query per segment, max_q 1) against their blocks of a paged
    pool, the block table and lengths int32 on the device, against the reference on each segment's rows gathered
    by hand (causal: bottom-right aligned, each row on its own keys); out [T, H, D] and lse [H, T]; the rows of a
    segment without keys 0 and -inf; the inputs unchanged."""
    block, n_blocks, segments = PAGED_LAYOUTS[layout]
    h, hkv = HEADS[heads]
    dev = _device(backend)
    t = sum(n for n, _, _ in segments)
    q = _random((t, h, HEAD_DIM), dtype, dev, 91)
    k_pool = _random((n_blocks, block, hkv, HEAD_DIM), dtype, dev, 92)
    v_pool = _random((n_blocks, block, hkv, HEAD_DIM), dtype, dev, 93)
    width = max(len(blocks) for _, _, blocks in segments)
    table = [list(blocks) + [n_blocks - 1] * (width - len(blocks)) for _, _, blocks in segments]
    cu = [0]
    for n, _, _ in segments:
        cu.append(cu[-1] + n)
    tab, cu_t, used = (torch.tensor(x, dtype=torch.int32, device=dev) for x in (table, cu, [k for _, k, _ in segments]))
    inputs = [x.clone() for x in (q, k_pool, v_pool, tab, cu_t, used)]
    max_q, max_k = max(n for n, _, _ in segments), max(k for _, k, _ in segments)
    out, lse = backend.forward_paged(q, k_pool, v_pool, tab, cu_t, used, max_q, max_k, SCALE, causal)
    _assert_result("paged forward out", out, q, (t, h, HEAD_DIM), _value_dtypes(dtype))
    _assert_result("paged forward lse", lse, q, (h, t), (accumulator_dtype(dtype),))
    ref_out = torch.zeros((t, h, HEAD_DIM), dtype=torch.float64)
    ref_lse = torch.full((h, t), -math.inf, dtype=torch.float64)
    for (n, keys, blocks), c0 in zip(segments, cu):
        if keys == 0:
            continue
        k_rows, v_rows = (x[list(blocks)].flatten(0, 1)[None, :keys] for x in (k_pool, v_pool))
        for m in range(n):
            seen = keys - n + m + 1 if causal else keys
            row = q[None, c0 + m : c0 + m + 1]
            o, lrow = reference_attention(row, k_rows[:, :seen], v_rows[:, :seen], "none", SCALE)
            ref_out[c0 + m], ref_lse[:, c0 + m] = o[0, 0], lrow[0, :, 0]
    what = f"({'causal' if causal else 'full'}, {heads}, blocks of {block}, segments {segments})"
    assert_close(f"paged forward out {what}", out, ref_out, dtype)
    assert_natural_log("paged forward lse", lse, ref_lse)
    assert_close(f"paged forward lse {what}", lse, ref_lse, dtype)
    for (_, keys, _), c0, c1 in zip(segments, cu, cu[1:]):
        if keys == 0 and out[c0:c1].count_nonzero() > 0:
            raise AssertionError("paged forward out: a segment without keys must give an all-zero output")
    _assert_unchanged("paged forward", inputs, [q, k_pool, v_pool, tab, cu_t, used])


# ---------------------------------------------------------------------------------------------- score mods

SOFTCAP = 0.9
"""A cap below the test scores' spread (so tanh bends them), and not 1: catches a cap ignored or misplaced."""


def _score_mod(backend: Backend, mod: str, sq: int, sk: int) -> dict[str, Any]:
    """The keyword argument of ``mod`` for a block of ``sq`` queries and ``sk`` keys: the cap, or ALiBi with
    strided, offset global positions (keys before and after the queries, as a ring's blocks have them)."""
    if mod == "softcap":
        return {"softcap": SOFTCAP}
    dev = _device(backend)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32, device=dev)
    q_pos = torch.arange(sq, device=dev) * 3 + 7
    k_pos = torch.arange(sk, device=dev) * 3 + 5
    return {"alibi": Alibi(slopes, q_pos, k_pos)}


def _reference_mod(mods: dict[str, Any]) -> dict[str, Any]:
    """The reference's arguments for a kernel's ``mods``."""
    alibi = mods.get("alibi")
    return {"softcap": mods.get("softcap"), "alibi": None if alibi is None else tuple(alibi)}


def check_score_mod(backend: Backend, dtype: torch.dtype, mod: str) -> None:
    """A score modification the backend declares (``score_mods``) in its block forward and backward, against
    the reference with the same modification: ``causal`` (else ``none``) blocks in GQA."""
    mask = "causal" if "causal" in backend.masks else "none"
    q, k, v, dout = _block_inputs(backend, dtype, "gqa", SEQ, SEQ, 91, HEAD_DIM)
    q = q * 3  # scores spread beyond the cap
    mods = _score_mod(backend, mod, SEQ, SEQ)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference_gradients(dout, q, k, v, mask, SCALE, **_reference_mod(mods))
    out, lse = backend.forward(q, k, v, mask, SCALE, **mods)
    assert_close(f"forward out ({mod})", out, ref_out, dtype)
    assert_close(f"forward lse ({mod})", lse, ref_lse, dtype)
    grads = backend.backward(
        dout, q, k, v, ref_out.to(q.device, dtype), ref_lse.to(q.device, accumulator_dtype(dtype)), mask, SCALE, **mods
    )
    _check_gradients(("backward", "backward", f" ({mod})"), grads, (q, k, v), (ref_dq, ref_dk, ref_dv), dtype)


# ---------------------------------------------------------------------------------------------- ring


def check_ring(backend: Backend, dtype: torch.dtype, world_size: int, causal: bool, balance: str) -> None:
    """The whole ring on a :class:`xcp.LocalWorld` of ``world_size`` threads: out, lse, dq, dk, dv of
    every rank, gathered, against the reference on the whole sequence.

    Each rank drives :func:`xcp.ring_forward` and :func:`xcp.ring_backward` itself, because autograd
    runs the backward of GPU tensors on one worker thread, where ranks waiting for each other would hang.
    The forward is also run through :func:`xcp.attention` with ``device=backend.name``.
    """
    dev = _device(backend)
    h, hkv = HEADS["gqa"]
    q = _random((1, RING_SEQ, h, HEAD_DIM), dtype, dev, 41)
    k = _random((1, RING_SEQ, hkv, HEAD_DIM), dtype, dev, 42)
    v = _random((1, RING_SEQ, hkv, HEAD_DIM), dtype, dev, 43)
    dout = _random((1, RING_SEQ, h, HEAD_DIM), dtype, dev, 44)
    mask = "causal" if causal else "none"
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference_gradients(dout, q, k, v, mask, SCALE)

    def parts(x: torch.Tensor, rank: int) -> torch.Tensor:
        return shard(x, world_size, rank, dim=1, balance=balance)

    def rank_body(group: Any) -> tuple[torch.Tensor, ...]:
        from ..api import attention

        r = group.rank()
        qr, kr, vr, dr = parts(q, r), parts(k, r), parts(v, r), parts(dout, r)
        cfg = RingConfig(comm=group, backend=backend, causal=causal, scale=SCALE, balance=balance)
        with torch.no_grad():
            out, lse = ring_forward(qr, kr, vr, cfg)
            dq, dk, dv = ring_backward(dr, qr, kr, vr, out, lse, cfg)
            api_out = attention(
                qr, kr, vr, causal=causal, group=group, scale=SCALE, balance=balance, device=backend.name
            )
        return out, lse, dq, dk, dv, api_out

    results = LocalWorld(world_size, device=dev, timeout=60.0).run(rank_body)
    backend.synchronize(dev)
    gathered = [unshard([res[i] for res in results], dim=1, balance=balance) for i in (0, 2, 3, 4, 5)]
    lse = unshard([res[1] for res in results], dim=2, balance=balance)
    what = f"ring P={world_size} causal={causal} balance={balance}"
    assert_close(f"{what} out", gathered[0], ref_out, dtype)
    assert_close(f"{what} lse", lse, ref_lse, dtype)
    assert_close(f"{what} dq", gathered[1], ref_dq, dtype)
    assert_close(f"{what} dk", gathered[2], ref_dk, dtype)
    assert_close(f"{what} dv", gathered[3], ref_dv, dtype)
    assert_close(f"{what} out through xcp.attention(device={backend.name!r})", gathered[4], ref_out, dtype)


# ---------------------------------------------------------------------------------------------- the list


def _case(name: str, check: Callable[..., None], **kwargs: Any) -> Case:
    return Case(name, check, tuple(kwargs.items()))


def cases(backend: Backend) -> list[Case]:
    """Every check for ``backend``: for each dtype and mask it claims, in MHA and GQA, dense and packed
    (varlen) blocks and storage ranges (``forward_range``), plus streams, events, hand-off, memory
    statistics and full rings of 2 and 3 ranks."""
    out = [
        _case("identity", check_identity),
        _case("registered", check_registered),
        _case("streams", check_streams),
        _case("events", check_events),
        *(_case(f"handoff-{p}", check_handoff, policy=p) for p in HANDOFF_POLICIES),
        _case("handoff-default", check_handoff_default),
        _case("memory-stats", check_memory_stats),
    ]
    for dtype in backend.dtypes:
        d = _dtype_name(dtype)
        for mask in backend.masks:
            for heads in HEADS:
                out.append(_case(f"forward-{d}-{mask}-{heads}", check_forward, dtype=dtype, mask=mask, heads=heads))
                out.append(_case(f"backward-{d}-{mask}-{heads}", check_backward, dtype=dtype, mask=mask, heads=heads))
        # The ring's unmasked rectangular blocks: zigzag "lower" (all queries, half the keys) and "upper".
        for label, sq, sk in (("lower", SEQ, SEQ // 2 + 1), ("upper", SEQ // 2 + 1, SEQ)):
            shape = {"dtype": dtype, "mask": "none", "heads": "gqa", "sq": sq, "sk": sk}
            out.append(_case(f"forward-{d}-{label}", check_forward, **shape))
            out.append(_case(f"backward-{d}-{label}", check_backward, **shape))
        out.append(_case(f"split-keys-{d}", check_split_keys, dtype=dtype))
        # Packed documents: forward_varlen / backward_varlen (the base class's per-segment loop, or a
        # backend's varlen kernel).
        fillers = FILLER_LAYOUTS if getattr(backend, "varlen_fillers", False) else {}
        for layout, (_, _, causal) in {**VARLEN_LAYOUTS, **fillers}.items():
            if causal and "causal" not in backend.masks:
                continue
            for heads in HEADS:
                shape = {"dtype": dtype, "layout": layout, "heads": heads}
                out.append(_case(f"varlen-forward-{d}-{layout}-{heads}", check_forward_varlen, **shape))
                out.append(_case(f"varlen-backward-{d}-{layout}-{heads}", check_backward_varlen, **shape))
        out.append(_case(f"varlen-split-keys-{d}", check_split_keys_varlen, dtype=dtype))
        # Values of another head dim than q/k's (multi-head latent attention): narrower and wider, where the
        # backend declares value_head_dims.
        for dv in VALUE_DIMS if getattr(backend, "value_head_dims", False) else ():
            mask = "causal" if "causal" in backend.masks else "none"
            for name, check, where in (
                ("forward", check_forward, {"mask": mask}),
                ("backward", check_backward, {"mask": mask}),
                ("varlen-forward", check_forward_varlen, {"layout": "full"}),
                ("varlen-backward", check_backward_varlen, {"layout": "full"}),
                ("range", check_forward_range, {"ends": "inner"}),
            ):
                out.append(_case(f"{name}-{d}-gqa-dv{dv}", check, dtype=dtype, heads="gqa", value_dim=dv, **where))
        # Score modifications (soft-capping, ALiBi), where the backend declares them.
        for mod in getattr(backend, "score_mods", ()):
            out.append(_case(f"{mod}-{d}", check_score_mod, dtype=dtype, mod=mod))
        # A KV cache's decode step: forward_range over a storage range given on the device.
        for ends in RANGE_CASES:
            for heads in HEADS if ends == "inner" else ("gqa",):
                shape = {"dtype": dtype, "ends": ends, "heads": heads}
                out.append(_case(f"range-{d}-{ends}-{heads}", check_forward_range, **shape))
        # A paged cache's local partial: forward_paged over blocks of a pool, block table and lengths on the device.
        for causal, heads in ((False, "mha"), (False, "gqa"), (True, "gqa")):
            kind = "causal" if causal else "full"
            out.append(_case(f"paged-{d}-{kind}-{heads}", check_forward_paged, dtype=dtype, causal=causal, heads=heads))
        # ... and a decode step's call: one query per segment, blocks of 16 rows.
        out.append(_case(f"paged-{d}-decode-gqa", check_forward_paged, dtype=dtype, causal=False, heads="gqa",
                         layout="decode"))  # fmt: skip
        for world_size in (2, 3):
            for causal, balance, needs in RING_LAYOUTS:
                if all(m in backend.masks for m in needs):
                    kind = f"{'causal' if causal else 'full'}-{balance}"
                    out.append(
                        _case(
                            f"ring-{d}-P{world_size}-{kind}",
                            check_ring,
                            dtype=dtype,
                            world_size=world_size,
                            causal=causal,
                            balance=balance,
                        )
                    )
    return out


def run_all(backend: Backend) -> list[tuple[str, str]]:
    """Run every case; return ``(case id, error)`` for each that failed (empty when the backend conforms)."""
    failures = []
    for case in cases(backend):
        try:
            case.run(backend)
        except AssertionError as exc:
            failures.append((case.id, str(exc)))
    return failures
