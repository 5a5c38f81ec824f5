#!/usr/bin/env bash
# Everything xcp checks and times on one NVIDIA GPU, in one call of the device tool (see docs/benchmarks.md).
#   benchmarks/h200.sh checks   # device tests, conformance suite, fused merge, xcp run, CSAN, quick bench
#   benchmarks/h200.sh bench    # the full xcp bench grid with JSON and plot
#   benchmarks/h200.sh masks    # documents, windows, sinks, compile: checks and the 128K documents bench
#   benchmarks/h200.sh window   # the 128K sliding-window bench
#   benchmarks/h200.sh perf     # cuda tests, world of one vs SDPA, 16K/64K rings, host µs per step, GPU and host profiles
#   benchmarks/h200.sh ulysses  # the hybrid all-to-all + ring: xcp run checks, the 128K bench for U = 1, 2, 4, 8
#   benchmarks/h200.sh rings    # 16K and 64K over 8 virtual ranks, host µs per step
#   benchmarks/h200.sh quick    # cuda and LocalWorld tests, 16K over 2 and 8 ranks, host µs per step
#   benchmarks/h200.sh turns    # LocalWorld tests, world of one, 16K over 8 ranks, host per step, world_profile.py
#   benchmarks/h200.sh replay   # cuda tests, then 16K/64K/128K rings and the hybrid at 16K, eager and replayed as graphs
#   benchmarks/h200.sh pairs    # cuda tests, 16K/64K over 8 ranks with and without the pair kernels, GPU profile
#   benchmarks/h200.sh renovated  # cuda tests, conformance, settings, the files of one call, xcp run
#   benchmarks/h200.sh renovated-bench  # 16K/64K over 8 ranks eager and replayed, world of one, host µs per step
#   benchmarks/h200.sh decode   # KV cache: graph-replay, memory and CSAN tests, forward_range tests, xcp bench --decode
#                               # (B 8, 32/8 heads, D 128, bf16, P 8: L 128K with a chunk of 4096, L 1M)
#   benchmarks/h200.sh chunk    # KV cache cuda tests, host µs and launch costs, a chunk's kernels over 8 ranks and
#                               # one, a chunk of 4096 after 128K (B 1 and B 8), B 8 decode at 128K
#   benchmarks/h200.sh mla      # values of another head dim (q/k 192, v 128): tests, conformance dv cases, xcp run,
#                               # the 64K/128K causal rings over 8 ranks (32 heads, MHA) and 128K packed documents
#                               # (about 2 minutes on the H200)
#   benchmarks/h200.sh mla-profile  # 192/128: each block mask's cost per pair through the backend, an unmasked
#                               # square as two causal calls, the 64K rings' device time by kernel (stripe, zigzag)
#   benchmarks/h200.sh mla-ring # 192/128: cuda tests, the add kernel against torch's, the 64K/128K rings (zigzag,
#                               # stripe) and the hybrid (U = 4, 8) over 8 ranks, the 32/8 x 128 ring, a profile (~6 min)
#   benchmarks/h200.sh recurrent  # hybrid layers: fla from the carried wheels (WHEELS, default .whl) into /tmp/site,
#                               # the recurrent cuda tests (fla vs torch kernels, state passing, CSAN), xcp bench
#                               # --recurrent at 256K (with the block stack) and 1M, bf16, P 8 (about 8 minutes with
#                               # a cold Triton cache: fla's kernels compile and autotune on first use)
#   benchmarks/h200.sh mla-error  # 192/128 bf16 error against float64 beside SDPA's, with and without the causal
#                               # backward of unmasked blocks (8K over 2 ranks: its squares of 2048 rows)
#   benchmarks/h200.sh fillers  # varlen calls with filler segments: cuda tests, conformance varlen cases, the 128K
#                               # longtail documents over 8 ranks, document_zigzag (one call a step) beside zigzag
#   benchmarks/h200.sh serve    # paged, ragged decode: the paged tests (CPU stand-ins and cuda: PagedDecode replayed
#                               # 200 steps = eager, allocations, CSAN on the combine, the Triton paged decode against
#                               # float64 and replayed), the paged conformance cases, the flash paged form probed at
#                               # blocks of 16, 64, 256, 512, the decode kernels timed side by side at the targets'
#                               # shapes (benchmarks/paged_decode_probe.py), xcp bench --serve at the targets
#                               # (32 requests 4K..256K, ~1.5M tokens, P 8, 32/8 heads, D 128, bf16; ~6-7 min)
# Output goes to $OUT (the device tool's return folder) or ./out.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 || { cat "$out/install.txt"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
section() { printf '\n===== %s (%ss)\n' "$1" "$SECONDS"; }
case "${1:-checks}" in
checks)
  section "device tests"
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_device_backends.py 2>&1 | tail -25 | tee "$out/device_tests.txt"
  section "device tests, GQA by repeating K/V"
  XCP_CUDA_GQA=repeat timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_device_backends.py -k cuda 2>&1 | tail -3
  section "conformance suite on cuda"
  timeout 240 python3 -m xcp.testing --xcp-backend cuda -q -p no:cacheprovider 2>&1 | tail -25 | tee "$out/conformance.txt"
  section "fused merge"
  timeout 60 python3 benchmarks/merge_check.py 2>&1 | tee "$out/merge.txt"
  section "xcp run on cuda"
  timeout 120 xcp run --device cuda --dtype bfloat16 --seq 4096 --heads 32 --kv-heads 8 --head-dim 128 2>&1 | tee "$out/run.txt"
  section "quick bench"
  timeout 200 xcp bench --seqs 16384,65536 --worlds 2,8 --reps 3 --memory-seq 65536 --memory-worlds 2,8 --quiet \
    --json "$out/quick.json" 2>&1 | tee "$out/quick.txt"
  ;;
bench)
  section "lifetime rules on cuda: CSAN, graph capture, ledger vs allocator"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -rA tests/test_lifetime_cuda.py 2>&1 | tail -30 | tee "$out/lifetime_cuda.txt"
  section "xcp bench (the full grid)"
  timeout 330 xcp bench --reps 2 --memory-seq 131072 --seqs 65536,131072,16384 --json "$out/bench.json" --plot "$out/bench.png" --quiet 2>&1 | tee "$out/bench.txt"
  ;;
masks)
  section "cuda backend tests (varlen, window, stand-in and device)"
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_backend.py 2>&1 | tail -4 | tee "$out/cuda_backend.txt"
  section "conformance suite on cuda: varlen cases"
  timeout 120 python3 -m xcp.testing --xcp-backend cuda -q -p no:cacheprovider -k varlen 2>&1 | tail -4 | tee "$out/conformance_varlen.txt"
  section "varlen kernel check"
  timeout 90 python3 benchmarks/device_varlen_check.py 2>&1 | tee "$out/varlen_check.txt"
  section "ring with documents, windows, sinks; compile"
  timeout 150 python3 benchmarks/device_masks_check.py 2>&1 | tee "$out/masks_check.txt"
  section "xcp bench --documents (S = 128K, P = 8, causal)"
  timeout 200 xcp bench --documents longtail:512:32768 --seqs 131072 --worlds 8 --mask causal --compare-dense \
    --reps 3 --quiet --json "$out/documents.json" 2>&1 | tee "$out/documents.txt"
  ;;
window)
  section "xcp bench --window (S = 128K, P = 8, causal, window 4K)"
  timeout 240 xcp bench --window 4096,0 --balance contiguous --seqs 131072 --worlds 8 --mask causal --compare-dense \
    --reps 3 --quiet --json "$out/window.json" 2>&1 | tee "$out/window.txt"
  section "xcp bench --documents, balance stripe (the balance xcp.choose_balance picks for these documents)"
  timeout 200 xcp bench --documents longtail:512:32768 --balance stripe --seqs 131072 --worlds 8 --mask causal \
    --reps 3 --quiet --json "$out/documents_stripe.json" 2>&1 | tee "$out/documents_stripe.txt"
  ;;
perf)
  section "cuda tests: stand-ins, cuDNN and flash blocks on the GPU, lifetime rules (CSAN, graphs), LocalWorld, merge"
  timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_cuda_backend.py tests/test_lifetime_cuda.py \
    tests/test_world_of_one.py tests/test_localworld.py 2>&1 | tail -40 | tee "$out/cuda_tests.txt"
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_device_backends.py -k cuda 2>&1 | tail -3 \
    | tee -a "$out/cuda_tests.txt"
  timeout 60 python3 benchmarks/merge_check.py 2>&1 | tee -a "$out/cuda_tests.txt"
  section "xcp bench --world-of-one (S = 1K, 4K; against torch SDPA)"
  timeout 150 xcp bench --world-of-one --reps 9 --quiet 2>&1 | tee "$out/world_of_one.txt"
  section "rings over virtual ranks: 16K (P = 2, 8), 64K (P = 2, 8), both masks"
  {
    timeout 100 xcp bench --seqs 16384 --worlds 2,8 --reps 5 --no-graph --memory-seq 16384 --memory-worlds 8 --quiet \
      2>&1 | grep -E "^ +16384 +[28] "
    timeout 200 xcp bench --seqs 65536 --worlds 2,8 --reps 5 --no-graph --memory-seq 65536 --memory-worlds 8 --quiet \
      2>&1 | grep -E "^ +65536 +[28] |KV shards|MiB"
  } 2>&1 | tee "$out/rings.txt"
  section "xcp bench --host (host µs per ring step at 2K tokens per rank)"
  timeout 150 xcp bench --host --worlds 2,8 --host-tokens 2048 --mask causal --seqs 1024 --quiet 2>&1 | tee "$out/host.txt"
  section "device time by kind: 64K over 8 virtual ranks, causal and full, against one whole-sequence call"
  for m in causal full; do
    timeout 120 python3 benchmarks/ring_profile.py --seq 65536 --world 8 --mask $m 2>&1 | tee -a "$out/ring_profile.txt"
  done
  section "a ring step alone and among 8 cooperative ranks, under cProfile"
  timeout 120 python3 benchmarks/world_profile.py --top 30 2>&1 | tee "$out/world_profile.txt"
  ;;
ulysses)
  section "xcp run --ulysses on cuda (the hybrid's virtual ranks checked against float64)"
  for u in 2 8; do
    timeout 120 xcp run --device cuda --dtype bfloat16 --world 8 --ulysses $u --seq 4096 --heads 32 --kv-heads 8 \
      --head-dim 128 2>&1 | tee "$out/run_ulysses$u.txt"
  done
  section "xcp plan --ulysses 2 (S = 128K, P = 8): groups and bytes per step"
  xcp plan --world 8 --ulysses 2 --causal --seq 131072 2>&1 | tee "$out/plan_ulysses.txt" | tail -24
  section "xcp bench --ulysses 1,2,4,8 (S = 128K, P = 8, causal, 32/8 heads, D = 128, bf16)"
  timeout 420 xcp bench --ulysses 1,2,4,8 --seqs 131072 --worlds 8 --mask causal --reps 3 --quiet \
    --json "$out/ulysses.json" 2>&1 | tee "$out/ulysses.txt"
  ;;
rings)
  section "rings over 8 virtual ranks after the directed hand-over (16K, 64K; host µs per step)"
  {
    timeout 100 xcp bench --seqs 16384 --worlds 2,8 --reps 5 --no-graph --memory-seq 16384 --memory-worlds 8 --quiet \
      2>&1 | grep -E "^ +16384 +[28] "
    timeout 100 xcp bench --seqs 65536 --worlds 8 --reps 3 --no-graph --memory-seq 16384 --memory-worlds 8 --quiet \
      2>&1 | grep -E "^ +65536 +8 "
    timeout 100 xcp bench --host --worlds 8 --host-tokens 2048 --mask causal --seqs 1024 --quiet 2>&1 | grep -E "^ +8 causal"
  } 2>&1 | tee "$out/rings.txt"
  ;;
turns)
  section "LocalWorld tests on cuda"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_localworld.py tests/test_lifetime_cuda.py 2>&1 | tail -3 \
    | tee "$out/tests.txt"
  section "xcp bench --world-of-one (S = 1K, 4K; against torch SDPA)"
  timeout 150 xcp bench --world-of-one --reps 9 --quiet 2>&1 | grep -E "^ +[0-9]+ +(full|causal) " | tee "$out/world_of_one.txt"
  section "16K over 2 and 8 virtual ranks; host µs per step"
  {
    timeout 100 xcp bench --seqs 16384 --worlds 2,8 --reps 5 --no-graph --memory-seq 16384 --memory-worlds 8 --quiet \
      2>&1 | grep -E "^ +16384 +[28] +(full|causal)"
    timeout 100 xcp bench --host --worlds 8 --host-tokens 2048 --mask causal --seqs 1024 --quiet 2>&1 | grep -E "^ +8 causal"
  } 2>&1 | tee "$out/rings16k.txt"
  section "a ring step alone and among 8 cooperative ranks, under cProfile"
  timeout 120 python3 benchmarks/world_profile.py --top 30 2>&1 | tee "$out/world_profile.txt"
  section "accumulating bf16 gradients into float32"
  PYTHONPATH=. timeout 60 python3 benchmarks/accumulate_probe.py 2>&1 | tee "$out/accumulate.txt"
  ;;
quick)
  section "cuda tests: backend, lifetime rules (CSAN, graphs), LocalWorld"
  timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_cuda_backend.py tests/test_lifetime_cuda.py \
    tests/test_localworld.py 2>&1 | tail -5 | tee "$out/cuda_tests.txt"
  timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_device_backends.py -k cuda 2>&1 | tail -2 \
    | tee -a "$out/cuda_tests.txt"
  section "16K over 2 and 8 virtual ranks; host µs per step"
  {
    timeout 100 xcp bench --seqs 16384 --worlds 2,8 --reps 5 --no-graph --memory-seq 16384 --memory-worlds 8 --quiet \
      2>&1 | grep -E "^ +16384 +[28] +(full|causal)"
    timeout 100 xcp bench --host --worlds 2,8 --host-tokens 2048 --mask causal --seqs 1024 --quiet 2>&1 \
      | grep -E "^ +[28] causal|^ +1024 causal"
  } 2>&1 | tee "$out/rings16k.txt"
  ;;
replay)
  section "cuda tests: backend (one graph for a whole LocalWorld included), lifetime rules (CSAN, graphs), LocalWorld"
  timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_cuda_backend.py tests/test_lifetime_cuda.py \
    tests/test_localworld.py 2>&1 | tail -5 | tee "$out/cuda_tests.txt"
  section "16K and 64K over 2 and 8 virtual ranks, eager and replayed"
  timeout 240 xcp bench --replay --seqs 16384,65536 --worlds 2,8 --reps 5 --no-graph --memory-seq 65536 \
    --memory-worlds 8 --quiet --json "$out/replay.json" 2>&1 | tee "$out/replay.txt"
  section "128K causal over 8 virtual ranks, eager and replayed"
  timeout 120 xcp bench --replay --seqs 131072 --worlds 8 --mask causal --reps 5 --no-graph --memory-seq 16384 \
    --memory-worlds 8 --quiet 2>&1 | tee "$out/replay128k.txt"
  section "the hybrid at 16K over 8 ranks, eager and replayed"
  timeout 120 xcp bench --replay --ulysses 1,2,4,8 --seqs 16384 --worlds 8 --mask causal --reps 5 --quiet 2>&1 \
    | tee "$out/replay_ulysses.txt"
  ;;
pairs)
  section "cuda backend tests (the pair merge kernel included)"
  timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_cuda_backend.py tests/test_pair_merge.py \
    tests/test_lifetime_cuda.py tests/test_localworld.py 2>&1 | tail -5 | tee "$out/cuda_tests.txt"
  for pair in 1 0; do
    section "16K and 64K over 8 virtual ranks, XCP_CUDA_PAIR_MERGE=$pair, eager and replayed"
    XCP_CUDA_PAIR_MERGE=$pair timeout 200 xcp bench --replay --seqs 16384,65536 --worlds 8 --reps 5 --no-graph \
      --memory-seq 65536 --memory-worlds 8 --quiet --json "$out/pairs$pair.json" 2>&1 | tee "$out/pairs$pair.txt"
  done
  section "128K causal over 8 virtual ranks, eager and replayed"
  timeout 120 xcp bench --replay --seqs 131072 --worlds 8 --mask causal --reps 3 --no-graph --memory-seq 16384 \
    --memory-worlds 8 --quiet 2>&1 | grep -E "^ +131072" | tee "$out/pairs128k.txt"
  section "GPU time by kernel kind, 16K over 8 ranks, causal"
  PYTHONPATH=. timeout 120 python3 benchmarks/ring_profile.py --seq 16384 --world 8 --mask causal 2>&1 \
    | tee "$out/ring_profile_16k.txt"
  ;;
renovated)
  section "cuda tests: backend, pair kernels, lifetime rules (CSAN, graphs), LocalWorld, world of one, device backends"
  timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_cuda_backend.py tests/test_pair_merge.py \
    tests/test_lifetime_cuda.py tests/test_localworld.py tests/test_world_of_one.py tests/test_device_backends.py 2>&1 \
    | tail -15 | tee "$out/cuda_tests.txt"
  section "conformance suite on cuda"
  timeout 150 python3 -m xcp.testing --xcp-backend cuda -q -p no:cacheprovider 2>&1 | tail -3 | tee -a "$out/cuda_tests.txt"
  section "fused merge; xcp backends --settings; the files one CUDA call enters"
  timeout 60 python3 benchmarks/merge_check.py 2>&1 | tee -a "$out/cuda_tests.txt"
  xcp backends --settings 2>&1 | tee "$out/backends.txt"
  timeout 60 python3 benchmarks/call_files.py --device cuda --world 2 2>&1 | tee "$out/call_files.txt"
  section "xcp run on cuda (the warm call's time and the first call's)"
  timeout 120 xcp run --device cuda --dtype bfloat16 --seq 8192 --heads 32 --kv-heads 8 --head-dim 128 2>&1 \
    | tee "$out/run.txt"
  ;;
renovated-bench)
  section "16K and 64K over 8 virtual ranks, eager and replayed"
  timeout 240 xcp bench --replay --seqs 16384,65536 --worlds 8 --reps 5 --no-graph --memory-seq 65536 \
    --memory-worlds 8 --quiet --json "$out/renovated.json" 2>&1 | tee "$out/renovated.txt"
  section "xcp bench --world-of-one (S = 1K, 4K; against torch SDPA)"
  timeout 150 xcp bench --world-of-one --reps 9 --quiet 2>&1 | tee "$out/world_of_one.txt"
  section "xcp bench --host (host µs per ring step at 2K tokens per rank)"
  timeout 100 xcp bench --host --worlds 8 --host-tokens 2048 --mask causal --seqs 1024 --quiet 2>&1 | tee "$out/host.txt"
  ;;
decode)
  section "KV cache on cuda: captured decode steps replayed (world of one, 4 ranks in one graph), memory; CSAN of the ring and the combine; the cuda backend tests; conformance (range, varlen)"
  timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/test_cache_cuda.py tests/test_lifetime_cuda.py \
    tests/test_cuda_backend.py 2>&1 | tail -30 | tee "$out/decode_tests.txt"
  timeout 120 python3 -m xcp.testing --xcp-backend cuda -q -p no:cacheprovider -k "range or varlen" 2>&1 | tail -3 \
    | tee -a "$out/decode_tests.txt"
  section "fused P-way merge (the KV cache's combine) against the eager merge"
  timeout 90 python3 benchmarks/merge_check.py 2>&1 | tail -12 | tee "$out/decode_merge.txt"
  section "host µs per eager decode step of one rank alone (world of one; P = 8 with a loopback all-gather)"
  timeout 90 python3 benchmarks/decode_host_profile.py --worlds 1,8 --cached 16384 --top 25 --chunk 4096 2>&1 \
    | tee "$out/decode_host.txt" | grep -E "^P "
  section "xcp bench --decode: L = 128K over P = 8, and a chunk of 4096 after it (B 8, 32/8 heads, D 128, bf16)"
  timeout 180 xcp bench --decode --batch 8 --seqs 131072 --worlds 8 --chunk 4096 --heads 32 --kv-heads 8 --head-dim 128 \
    --dtype bfloat16 --warmup 1 --reps 5 --quiet --json "$out/decode128k.json" 2>&1 | tee "$out/decode128k.txt"
  section "xcp bench --decode: a chunk of 4096 after 128K, one sequence (B 1: chunked prefill), P = 8"
  timeout 120 xcp bench --decode --batch 1 --seqs 131072 --worlds 8 --chunk 4096 --heads 32 --kv-heads 8 --head-dim 128 \
    --dtype bfloat16 --warmup 1 --reps 5 --quiet --no-graph 2>&1 | tee "$out/decode128k_b1.txt"
  section "xcp bench --decode: L = 1M over P = 8 (the whole cache 32 GiB beside the 8 caches of 4 GiB)"
  timeout 210 xcp bench --decode --batch 8 --seqs 1048576 --worlds 8 --heads 32 --kv-heads 8 --head-dim 128 \
    --dtype bfloat16 --warmup 1 --reps 3 --quiet 2>&1 | tee "$out/decode1m.txt"
  ;;
chunk)
  section "KV cache on cuda: captured decode steps, memory, a chunk's two combines on 4 ranks"
  timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/test_cache_cuda.py 2>&1 | tail -15 \
    | tee "$out/chunk_tests.txt"
  section "host µs per eager decode step of one rank alone, and what single launches cost"
  timeout 60 python3 benchmarks/decode_host_profile.py --worlds 1,8 --cached 16384 --top 20 2>&1 \
    | tee "$out/chunk_host.txt" | grep -E "^P |^host|^  "
  bench=(--decode --seqs 131072 --worlds 8 --chunk 4096 --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16
         --warmup 1 --reps 5 --quiet)
  section "where a chunk's device time goes: its kernels over 8 ranks and over one"
  timeout 150 python3 benchmarks/chunk_profile.py --top 8 2>&1 | tee "$out/chunk_profile.txt" | grep -E "=====|flash_fwd|Self CUDA time"
  section "a chunk of 4096 after 128K, B 1, P 8 (virtual ranks: one all-gather of the partials)"
  timeout 100 xcp bench "${bench[@]}" --batch 1 --no-graph 2>&1 | tee "$out/chunk_b1.txt"
  section "B 8: decode at 128K replayed, and the chunk"
  timeout 150 xcp bench "${bench[@]}" --batch 8 --json "$out/chunk_b8.json" 2>&1 | tee "$out/chunk_b8.txt"
  ;;
mla)
  dims=(--head-dim 192 --value-head-dim 128 --dtype bfloat16)
  section "values of another head dim: xcp's tests (CPU paths, cuda blocks and varlen), conformance dv cases on cuda"
  timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_value_dim.py tests/test_cuda_backend.py \
    -k "value or another_head or too_wide" 2>&1 | tail -15 | tee "$out/mla_tests.txt"
  timeout 60 python3 -m xcp.testing --xcp-backend cuda -q -p no:cacheprovider -k dv 2>&1 | tail -5 \
    | tee -a "$out/mla_tests.txt"
  section "xcp run on cuda, q/k 192, v 128 (16 heads, MHA; against float64)"
  timeout 90 xcp run --device cuda --seq 4096 --heads 16 --kv-heads 16 "${dims[@]}" 2>&1 | tee "$out/mla_run.txt"
  section "xcp bench: 64K and 128K causal over 8 virtual ranks, 32 heads (MHA), q/k 192, v 128, bf16"
  timeout 200 xcp bench --seqs 65536,131072 --worlds 8 --mask causal --heads 32 --kv-heads 32 "${dims[@]}" --reps 3 \
    --no-graph --memory-seq 65536 --memory-worlds 8 --quiet --json "$out/mla.json" 2>&1 | tee "$out/mla.txt"
  section "xcp bench --documents (S = 128K, P = 8, causal), q/k 192, v 128"
  timeout 120 xcp bench --documents longtail:512:32768 --seqs 131072 --worlds 8 --mask causal --heads 32 --kv-heads 32 \
    "${dims[@]}" --reps 3 --quiet --json "$out/mla_documents.json" 2>&1 | tee "$out/mla_documents.txt"
  ;;
mla-profile)
  mla=(--heads 32 --kv-heads 32 --head-dim 192 --value-head-dim 128)
  section "what each block mask costs per pair at 192/128, and an unmasked square as two causal calls"
  timeout 150 python3 benchmarks/mla_masks.py --sizes 8192,16384 2>&1 | tee "$out/mla_masks.txt"
  for balance in stripe zigzag; do
    section "the ring's device time by kernel kind, 64K over 8 ranks, 192/128, $balance"
    timeout 120 python3 benchmarks/ring_profile.py --seq 65536 --world 8 --mask causal --balance $balance "${mla[@]}" \
      --top 16 2>&1 | tee "$out/mla_profile_$balance.txt"
  done
  ;;
mla-ring)
  mla=(--heads 32 --kv-heads 32 --head-dim 192 --value-head-dim 128 --dtype bfloat16)
  section "cuda tests: value head dims (causal backward), the add kernels, stripe on causal calls, conformance"
  timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_cuda_backend.py tests/test_value_dim.py \
    tests/test_pair_merge.py -k "value or another_head or causal_calls or add or pair" 2>&1 | tail -4 \
    | tee "$out/mla_ring_tests.txt"
  timeout 90 python3 -m xcp.testing --xcp-backend cuda -q -p no:cacheprovider -k "dv or stripe or lower or upper" 2>&1 \
    | tail -3 | tee -a "$out/mla_ring_tests.txt"
  section "a gradient's addition into float32: torch's mixed-dtype add against the Triton add"
  PYTHONPATH=. timeout 60 python3 benchmarks/accumulate_probe.py 2>&1 | tee "$out/accumulate.txt"
  for balance in zigzag stripe; do
    section "xcp bench: 64K and 128K causal over 8 virtual ranks, 32 heads (MHA), 192/128, bf16, $balance"
    timeout 110 xcp bench --seqs 65536,131072 --worlds 8 --mask causal "${mla[@]}" --balance $balance --reps 3 \
      --no-graph --memory-seq 65536 --memory-worlds 8 --quiet --json "$out/mla_$balance.json" 2>&1 | tee "$out/mla_$balance.txt"
  done
  section "xcp bench: the hybrid, U = 4, 8 over 8 ranks, 64K and 128K, 192/128"
  timeout 120 xcp bench --ulysses 4,8 --seqs 65536,131072 --worlds 8 --mask causal "${mla[@]}" --reps 3 --no-graph \
    --memory-seq 65536 --memory-worlds 8 --quiet --json "$out/mla_ulysses.json" 2>&1 | tee "$out/mla_ulysses.txt"
  section "xcp bench: the usual layer (32/8 heads, D 128), 64K and 128K causal over 8 ranks, zigzag"
  timeout 100 xcp bench --seqs 65536,131072 --worlds 8 --mask causal --reps 3 --no-graph --memory-seq 65536 \
    --memory-worlds 8 --quiet --json "$out/gqa128.json" 2>&1 | tee "$out/gqa128.txt"
  section "the ring's device time by kernel kind, 64K over 8 ranks, 192/128, stripe"
  timeout 60 python3 benchmarks/ring_profile.py --seq 65536 --world 8 --mask causal --balance stripe "${mla[@]:0:8}" \
    --top 14 2>&1 | tee "$out/mla_profile_stripe.txt"
  ;;
fillers)
  section "cuda tests: varlen calls with filler segments (no keys / no queries), conformance varlen cases on cuda"
  timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_cuda_backend.py -k "varlen or filler" 2>&1 \
    | tail -3 | tee "$out/fillers_tests.txt"
  timeout 90 python3 -m xcp.testing --xcp-backend cuda -q -p no:cacheprovider -k varlen 2>&1 | tail -3 \
    | tee -a "$out/fillers_tests.txt"
  for balance in document_zigzag zigzag; do
    section "xcp bench --documents (S = 128K, P = 8, causal), balance $balance"
    timeout 100 xcp bench --documents longtail:512:32768 --seqs 131072 --worlds 8 --mask causal --balance $balance \
      --reps 3 --quiet 2>&1 | tee "$out/fillers_$balance.txt"
  done
  ;;
recurrent)
  section "fla-core and einops from the carried wheels into /tmp/site"
  python3 -m pip install -q --no-deps --upgrade --target /tmp/site "${WHEELS:-.whl}"/fla_core-*.whl "${WHEELS:-.whl}"/einops-*.whl \
    >>"$out/install.txt" 2>&1 || { tail -5 "$out/install.txt"; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -m xcp backends 2>&1 | grep "^cuda recurrent" | tee "$out/recurrent_kernels.txt"
  section "recurrent cuda tests: fla vs the torch kernels, state passing with them, CSAN on the summaries and halos"
  timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/test_recurrent_cuda.py \
    tests/test_recurrent_kernels.py 2>&1 | tee "$out/recurrent_tests.txt" | tail -15
  section "xcp bench --recurrent: 256K over 8 ranks, bf16, gated delta (16 x 128) and Mamba2, and the block stack"
  timeout 180 xcp bench --recurrent --seqs 262144 --worlds 8 --reps 3 --warmup 1 --stack 2>&1 \
    | tee "$out/recurrent_256k.txt"
  section "xcp bench --recurrent: 1M over 8 ranks"
  timeout 100 xcp bench --recurrent --seqs 1048576 --worlds 8 --reps 2 --warmup 1 2>&1 | tee "$out/recurrent_1m.txt"
  ;;
serve)
  export XCP_CUDA_TRITON_DECODE=auto  # the Triton paged decode: off by default until this mode has checked it
  section "paged decode tests: CPU stand-ins (forward_paged, PagedDecode) and cuda (replayed = eager, allocations, CSAN)"
  timeout 180 python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/test_paged_cuda.py tests/test_paged_decode.py \
    tests/test_paged_triton.py tests/test_cuda_backend.py -k "paged or Paged or sanitizer" 2>&1 | tail -25 \
    | tee "$out/serve_tests.txt"
  timeout 60 python3 -m xcp.testing --xcp-backend cuda -q -p no:cacheprovider -k paged 2>&1 | tail -3 \
    | tee -a "$out/serve_tests.txt"
  section "the flash varlen op's paged form: block sizes 16, 64, 256, 512 accepted? exact against float64?"
  timeout 60 python3 benchmarks/paged_probe.py --blocks 16,64,256,512 2>&1 | tee "$out/serve_probe.txt"
  section "the decode kernels at the target's shapes: flash varlen seqused_k (the yardstick), Triton paged, flash paged"
  timeout 60 python3 benchmarks/paged_decode_probe.py --world 8 2>&1 | tee "$out/serve_decode_probe.txt"
  section "xcp bench --serve: 32 requests 4K..256K (~1.5M tokens) over 8 ranks, 32/8 heads, D 128, bf16, blocks of 256"
  timeout 300 xcp bench --serve --serve-requests 32 --serve-lengths 4096:262144:1500000 --serve-world 8 \
    --serve-block 256 --serve-chunk 4096 --serve-steps 1000 --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 \
    --warmup 2 --reps 7 --quiet --json "$out/serve.json" 2>&1 | tee "$out/serve.txt"
  ;;
mla-error)
  for low in 8192 1024; do
    section "bf16 error at 192/128 against float64 beside SDPA's, 8K over 2 ranks, causal backward from $low rows"
    timeout 120 python3 benchmarks/mla_error.py --seq 8192 --world 2 --heads 8 --causal-backward-min $low 2>&1 \
      | tee "$out/mla_error_$low.txt"
  done
  ;;
*) echo "usage: $0 checks|bench|masks|window|perf|ulysses|rings|turns|quick|replay|pairs|renovated|renovated-bench|decode|chunk|mla|mla-profile|mla-ring|fillers|mla-error|recurrent|serve" >&2; exit 2 ;;
esac
section done
