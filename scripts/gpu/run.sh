#!/usr/bin/env bash
# Runs on the GPU machine from the working-tree root, after `. .gpu/device-env.sh`:
# (1) every case on CUDA for every strategy and n in {1, 2, 4} (f32 and bf16),
# (2) the forward + backward benchmark; one table at the end of each.
set -uo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$dir}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== correctness"
"$dir/gpu_check" "$dir/cases" | tee "$out/gpu_check.txt"
check=${PIPESTATUS[0]}
echo "== benchmark"
"$dir/gpu_bench" --json "$out/gpu_bench.json" | tee "$out/gpu_bench.txt"
exit "$check"
