"""The ``XCP_CUDA_*`` variables of the CUDA backend, read when :class:`xcp_cuda.CUDABackend` is built
(each has a constructor argument that overrides it) and listed in its ``settings`` attribute."""

from __future__ import annotations

from xcp.backends.fused import gqa_variable
from xcp.settings import READ_AT_CONSTRUCTION, Setting

GQA = gqa_variable("XCP_CUDA_GQA")
FLASH_ATTN = Setting(
    "XCP_CUDA_FLASH_ATTN",
    "flag",
    True,
    "0: blocks the aten flash op serves never use the flash-attn package's forward, even where it is "
    "installed; constructor argument use_flash_attn=",
    READ_AT_CONSTRUCTION,
)
CUDNN = Setting(
    "XCP_CUDA_CUDNN",
    "flag",
    True,
    "0: fp16/bf16 blocks stay on the flash op where torch's SDPA would run them on cuDNN; constructor "
    "argument use_cudnn=",
    READ_AT_CONSTRUCTION,
)
FUSED_MERGE = Setting(
    "XCP_CUDA_FUSED_MERGE",
    "flag",
    None,
    "0: the eager merge of blocks instead of the one-pass Triton kernel (for comparisons; unset: Triton "
    "where it is installed); constructor argument fused_merge=",
    READ_AT_CONSTRUCTION,
)
PAIR_MERGE = Setting(
    "XCP_CUDA_PAIR_MERGE",
    "flag",
    True,
    "0: blocks are folded (and dQ added) one at a time, none held for the next (for comparisons); "
    "constructor argument pair_merge=",
    READ_AT_CONSTRUCTION,
)
FAST_LAUNCH = Setting(
    "XCP_CUDA_FAST_LAUNCH",
    "flag",
    True,
    "0: every Triton launch takes Triton's own binding path, never a compiled kernel seen before "
    "(for comparisons); constructor argument fast_launch=",
    READ_AT_CONSTRUCTION,
)

CAUSAL_BACKWARD = Setting(
    "XCP_CUDA_CAUSAL_BACKWARD",
    "flag",
    True,
    "0: an unmasked cuDNN block whose values have another head dim takes one unmasked backward call, not "
    "causal calls on its squares and their reversed rows (cuDNN's causal backward is cheaper per pair "
    "there); constructor argument causal_backward=",
    READ_AT_CONSTRUCTION,
)

FLA = Setting(
    "XCP_CUDA_FLA",
    "flag",
    True,
    "0: recurrent layers run the models' own torch kernels, never fla's Triton kernels where fla is installed "
    "(for comparisons); constructor argument use_fla=",
    READ_AT_CONSTRUCTION,
)

TRITON_DECODES = ("auto", "triton", "off")
"""The values of :data:`TRITON_DECODE`."""
TRITON_DECODE = Setting(
    "XCP_CUDA_TRITON_DECODE",
    "choice",
    "off",
    "which kernel runs a paged decode call (forward_paged with one query per segment): auto (flash's paged form "
    "where this torch's flash op takes block_table and the blocks hold a multiple of 256 rows, else xcp's Triton "
    "paged decode), triton (the Triton kernel wherever it serves), off (never the Triton kernel: flash's paged form "
    "or the gather; the default until the Triton kernel has run on a GPU: only Triton's interpreter has run it); "
    "constructor argument triton_decode=",
    READ_AT_CONSTRUCTION,
    TRITON_DECODES,
)

ALL: tuple[Setting, ...] = (
    GQA, FLASH_ATTN, CUDNN, FUSED_MERGE, PAIR_MERGE, FAST_LAUNCH, CAUSAL_BACKWARD, FLA, TRITON_DECODE
)  # fmt: skip
"""Every setting of the CUDA backend, in the order ``xcp backends --settings`` lists them."""
