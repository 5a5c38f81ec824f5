"""The ``XCP_NPU_*`` variables of the Ascend backend, read when :class:`xcp_npu.NPUBackend` is built (each
has a constructor argument that overrides it) and listed in its ``settings`` attribute."""

from __future__ import annotations

from xcp.backends.fused import gqa_variable
from xcp.settings import READ_AT_CONSTRUCTION, Setting

from .convert import TND_STATS_LAYOUTS

GQA = gqa_variable("XCP_NPU_GQA")
TND_STATS = Setting(
    "XCP_NPU_TND_STATS",
    "choice",
    "segment",
    "how the TND (packed segments) calls lay out softmax_max / softmax_sum: segment (per segment [N, s_i], what the "
    'kernels write by default) or tnd ([T, N], softmax_layout="TND": newer torch_npu and CANN); constructor '
    "argument tnd_stats=",
    READ_AT_CONSTRUCTION,
    TND_STATS_LAYOUTS,
)

ALL: tuple[Setting, ...] = (GQA, TND_STATS)
"""Every setting of the Ascend backend, in the order ``xcp backends --settings`` lists them."""
