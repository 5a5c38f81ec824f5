"""The ``sim`` backend: CPU tensors and the CPU kernel, with streams and events of the simulated device.

The ring code runs on it unchanged (all ranks of a LocalWorld included); what it does to streams, events,
hand-offs and memory is recorded by a :class:`~xcp.testing.sim_device.DeviceModel`. Every hand-off policy
is available (xcp.lifetime applies them over these primitives), so that tests can show which ones the
model accepts where.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..backends.cpu import CPUBackend
from ..hookspecs import hookimpl
from .sim_device import DeviceModel, SimEvent, SimStream


class SimBackend(CPUBackend):
    """CPU math kernels on simulated streams; its own hand-off policies, recorded by the model."""

    name = "sim"
    device_type = "cpu"
    dist_backend = "gloo"
    handoff_policy = "record_stream"
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

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Mark the tensor's block for ``stream``: the model's allocator will not reuse it before that work."""
        self.model.record_stream(tensor, stream)

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int] | None:
        return None


class SimPlugin:
    """Registers one session's sim backend (through :func:`xcp.plugins.register_plugin`)."""

    def __init__(self, backend: SimBackend) -> None:
        self.backend = backend

    @hookimpl
    def xcp_register_backends(self, register: Any) -> None:
        register(self.backend)
