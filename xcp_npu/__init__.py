"""xcp's Ascend backend: torch_npu.npu_fusion_attention (+ grad), torch.npu streams, HCCL.

Registered through the entry point ``npu = "xcp_npu.plugin"`` of the group ``xcp``. Importing this
package never imports torch_npu; without it the backend is listed as unavailable with the import error.
"""

from .backend import NPUBackend

__all__ = ["NPUBackend"]
