#!/usr/bin/env bash
# Runs on the GPU machine from the working-tree root, after `. .gpu/device-env.sh`:
# (1) every case on CUDA for every strategy and n in {1, 2, 4} (f32 and bf16),
# (2) the forward + backward benchmark (both executors), (3) PyTorch eager's layer on the same
# GPU and shapes, with ours / theirs; one table at the end of each.
set -uo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$dir}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== correctness"
"$dir/gpu_check" "$dir/cases" | tee "$out/gpu_check.txt"
check=${PIPESTATUS[0]}
echo "== benchmark"
"$dir/gpu_bench" --json "$out/gpu_bench.json" | tee "$out/gpu_bench.txt"
echo "== PyTorch eager peer"
python3 "$dir/torch_gpu_peer.py" --ours "$out/gpu_bench.json" --json "$out/torch_gpu_peer.json" \
  | tee "$out/torch_gpu_peer.txt" || true
exit "$check"
