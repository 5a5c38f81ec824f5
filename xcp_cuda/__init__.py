"""xcp's CUDA backend: PyTorch's flash / memory-efficient attention ops, torch.cuda streams, NCCL.

Registered through the entry point ``cuda = "xcp_cuda.plugin"`` of the group ``xcp``. Importing this
package needs no GPU and imports no vendor package.
"""

from .backend import CUDABackend

__all__ = ["CUDABackend"]
