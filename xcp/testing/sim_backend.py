"""The ``sim`` backend: CPU tensors and the CPU kernel, with streams and events of the simulated device.

The ring code runs on it unchanged (all ranks of a LocalWorld included); what it does to streams, events,
hand-offs and memory is recorded by a :class:`~xcp.testing.sim_device.DeviceModel`. Every hand-off policy
is available, so that tests can show which ones the model accepts where.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..backend import HANDOFF_POLICIES, check_handoff
from ..cpu import CPUBackend
from ..hookspecs import hookimpl
from .sim_device import DeviceModel, SimEvent, SimStream


class SimBackend(CPUBackend):
    """CPU math kernels on simulated streams; its own hand-off policies, recorded by the model."""

    name = "sim"
    device_type = "cpu"
    dist_backend = "gloo"
    handoff_policy = "record_stream"
    handoff_policies = HANDOFF_POLICIES
    kernel = "math (matmul-softmax) on simulated streams (lifetime sanitizer)"

    def __init__(self, model: DeviceModel) -> None:
        self.model = model

    def available(self) -> tuple[bool, str]:
        return True, ""

    # streams and events
    def current_stream(self, device: torch.device | None = None) -> SimStream:
        return self.model.current_stream()

    def new_stream(self, device: torch.device | None = None, name: str | None = None) -> SimStream:
        return self.model.new_stream(name)

    def stream_context(self, stream: SimStream) -> contextlib.AbstractContextManager:
        return self.model.use_stream(stream)

    def new_event(self) -> SimEvent:
        return SimEvent(self.model)

    def record_event(self, event: SimEvent, stream: SimStream) -> None:
        self.model.record(event, stream)

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        self.model.wait_event(stream, event)

    def wait_stream(self, stream: SimStream, other: SimStream) -> None:
        self.model.wait_stream(stream, other)

    def synchronize_event(self, event: SimEvent) -> None:
        self.model.sync_event(event)

    def is_capturing(self) -> bool:
        return self.model.capturing()

    def label(self, text: str) -> contextlib.AbstractContextManager:
        """Name the ops issued inside (LocalWorld labels its peer-to-peer copies ``p2p ...``)."""
        return self.model.label(text)

    # hand-off
    def handoff(self, tensor: torch.Tensor, consumer_stream: Any, policy: str | None = None) -> torch.Tensor:
        """``record_stream`` marks the block for the consumer; ``clone`` copies on the consumer stream (its
        pool owns the copy); ``event`` and ``none`` return the tensor (ordering is the caller's)."""
        policy = check_handoff(policy or self.handoff_policy)
        if policy == "record_stream":
            self.model.record_stream(tensor, consumer_stream)
            return tensor
        if policy == "clone":
            with self.stream_context(consumer_stream):
                return tensor.clone()
        return tensor

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int] | None:
        return None


class SimPlugin:
    """Registers one session's sim backend (through :func:`xcp.plugins.register_plugin`)."""

    def __init__(self, backend: SimBackend) -> None:
        self.backend = backend

    @hookimpl
    def xcp_register_backends(self, register: Any) -> None:
        register(self.backend)
