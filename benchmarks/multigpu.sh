#!/usr/bin/env bash
# Ring attention over N GPUs of one host with NCCL: correctness, efficiency and memory (issue 6).
#   benchmarks/multigpu.sh [N] [extra `xcp bench --distributed` flags]
# N defaults to the number of visible GPUs. Writes multigpu-N.json in the current directory.
set -euo pipefail
n=${1:-$(python3 -c 'import torch; print(torch.get_device_module("cuda").device_count())')}
shift || true
# NVLink multicast (NVLS) and symmetric-memory multicast stay off on the lent machines (device KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
exec python3 -m torch.distributed.run --standalone --nproc-per-node "$n" -m xcp.cli bench --distributed \
  --device cuda --json "multigpu-$n.json" "$@"
