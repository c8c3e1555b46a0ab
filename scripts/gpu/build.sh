#!/usr/bin/env bash
# Build the GPU binaries here (no GPU needed) and stage them in .gpu/ for the device machine.
#   scripts/gpu/build.sh          # AUTOTUNE=1 for burn's matmul autotuning; TOOLS=0 for the
#                                 # check and the benchmark alone (no toy, no CLI: a shorter build);
#                                 # TOY=0 for the CLI without the toy
#   ALT_REV=REV scripts/gpu/build.sh
#                                 # also gpu_bench built at commit REV (a branch), as gpu_bench-alt,
#                                 # for run.sh's `ab` phase: both builds timed alternately in one
#                                 # call; ALT_TOOLS=1 adds that commit's CLI (mpipemoe-alt)
# Then, with the device tool: run with carry [".gpu"] and the command
#   . .gpu/device-env.sh && .gpu/run.sh 2>&1 | tee $OUT/log.txt
set -euo pipefail
cd "$(dirname "$0")/../.."
export CUDARC_CUDA_VERSION=13000
# AUTOTUNE=1 builds with burn's matmul autotuning (mpipemoe-cuda's `autotune` feature). Off by
# default: on a fresh H200 the toy with it finished no step in 240 s (each new GEMM shape
# compiles and times about seven kernels with NVRTC), without it the toy's first step came at
# 12.5 s (docs/design-notes.md, "CUDA's first minutes").
if [ "${ALT_TOOLS:-0}" = 1 ] && [ "${TOOLS:-1}" != 1 ]; then
  echo "error: ALT_TOOLS=1 compares the alt CLI with this build's, which TOOLS=0 leaves out" >&2
  exit 2
fi
cuda_features=cuda
tools_features=cuda
if [ "${AUTOTUNE:-0}" = 1 ]; then
  cuda_features=cuda,autotune
  tools_features=cuda-autotune
fi
cargo build --release -p mpipemoe-cuda --features "$cuda_features" --example gpu_check --example gpu_bench \
  --example gpu_memory
# The toy GPT-MoE with `--backend cuda|cuda-fusion` and `--comm nccl` (tools' `cuda` feature), and
# the `mpipemoe` CLI, whose `logits` / `generate` run the whole models of tests/data/models there.
binaries=(target/release/examples/gpu_check target/release/examples/gpu_bench target/release/examples/gpu_memory)
# TOY=0 leaves the toy out and keeps the CLI (a shorter build; before the binaries were
# packed with xz, the room an A/B's second CLI needed).
if [ "${TOOLS:-1}" = 1 ]; then
  if [ "${TOY:-1}" = 1 ]; then
    cargo build --release -p mpipemoe-tools --features "$tools_features" --example train_gpt_moe --bin mpipemoe
    binaries+=(target/release/examples/train_gpt_moe)
  else
    cargo build --release -p mpipemoe-tools --features "$tools_features" --bin mpipemoe
  fi
  binaries+=(target/release/mpipemoe)
fi
rm -rf .gpu
mkdir -p .gpu/cases .gpu/bin
# Four stripped binaries are over 100 MB, over what a run can carry; xz brings them to about a
# sixth (gzip -9 to about a quarter: the seven binaries of an A/B with the toy were 77.7 MB
# gzipped, 49 MB with xz, within the carry), and run.sh unpacks them into a temporary folder
# on the GPU machine (with xz, or with Python's lzma where the machine has no xz).
# Usage: stage PATH [NAME]
stage() {
  local name=${2:-$(basename "$1")}
  cp "$1" ".gpu/bin/$name"
  strip ".gpu/bin/$name"
  xz -9e -T2 ".gpu/bin/$name"
}
for path in "${binaries[@]}"; do
  stage "$path"
done
# The other side of an A/B, built from REV's sources in a worktree of its own. It shares this
# target folder: the dependencies' artifacts are the same, and cargo rebuilds only the
# workspace's crates, whose sources (at another path) it fingerprints again; the next plain
# build rebuilds them back. This build's binaries are staged above before they are
# overwritten.
if [ -n "${ALT_REV:-}" ]; then
  alt_rev=$(git rev-parse --verify "$ALT_REV^{commit}")
  alt_src="$PWD/target/alt-src"
  git worktree remove --force "$alt_src" 2>/dev/null || rm -rf "$alt_src"
  git worktree prune
  git worktree add --detach "$alt_src" "$alt_rev"
  alt_bins=(examples/gpu_bench)
  [ "${ALT_TOOLS:-0}" != 1 ] || alt_bins+=(mpipemoe)
  target_dir="$PWD/target"
  (
    cd "$alt_src"
    export CARGO_TARGET_DIR="$target_dir"
    cargo build --release -p mpipemoe-cuda --features "$cuda_features" --example gpu_bench
    # With the toy's example in the same command as this side's, so that the dependencies'
    # features unify as they did there and only the workspace's crates compile again (the CLI
    # alone rebuilt burn's crates: the example's dev-dependencies change their features).
    if [ "${ALT_TOOLS:-0}" = 1 ]; then
      toy=()
      [ "${TOY:-1}" != 1 ] || toy=(--example train_gpt_moe)
      cargo build --release -p mpipemoe-tools --features "$tools_features" "${toy[@]}" --bin mpipemoe
    fi
  )
  for path in "${alt_bins[@]}"; do
    stage "target/release/$path" "$(basename "$path")-alt"
  done
  git worktree remove --force "$alt_src"
  echo "$alt_rev ($ALT_REV)" >.gpu/ALT_BUILT_AT
fi
cp scripts/gpu/run.sh scripts/gpu/first_minutes.sh scripts/gpu/unpack.sh scripts/gpu/models.py .gpu/
cp scripts/bench/ab_table.py .gpu/
# The PyTorch eager peer (run when the GPU machine has PyTorch with CUDA).
cp scripts/bench/torch_peer.py scripts/bench/torch_gpu_peer.py .gpu/
cp tests/data/cases/*.safetensors .gpu/cases/
# The Hugging Face expected cases (DeepSeek-V3 routing, Mixtral, Qwen2-MoE) run the same way.
cp tests/data/hf/*.safetensors .gpu/cases/
# The repository's copy is the maintained one (its CUDA_PATH rule is tested by
# backend-ext/tests/device_env.rs).
cp scripts/gpu/device-env.sh .gpu/
# The commit the binaries were built at, and whether the tree had changes besides it, so that a
# later session can tell whether .gpu is current before it spends device time on it.
{
  git rev-parse HEAD
  git status --porcelain --untracked-files=no | grep -q . && echo "with uncommitted changes" || true
} >.gpu/BUILT_AT
cat .gpu/BUILT_AT
[ ! -f .gpu/ALT_BUILT_AT ] || echo "alt: $(cat .gpu/ALT_BUILT_AT)"
du -sh .gpu
ls -l .gpu
size=$(du -sb .gpu | cut -f1)
if [ "$size" -gt $((64 * 1024 * 1024)) ]; then
  echo "error: .gpu is $size bytes, over the 64 MiB that can be carried (TOY=0 leaves the toy out, TOOLS=0 the toy and the CLI)" >&2
  exit 1
fi
