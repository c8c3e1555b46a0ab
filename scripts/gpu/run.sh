#!/usr/bin/env bash
# Runs on the GPU machine from the working-tree root, after `. .gpu/device-env.sh`:
# (1) every case on CUDA for every strategy and n in {1, 2, 4} (f32 and bf16),
# (2) the toy GPT-MoE trained briefly on CUDA, raw and with fusion (the loss must fall),
# (3) the forward + backward benchmark (both executors), (4) PyTorch eager's layer on the same
# GPU and shapes, with ours / theirs; one table at the end of each.
set -uo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$dir}"
bin="$(mktemp -d)"
for packed in "$dir"/bin/*.gz; do
  name=$(basename "$packed" .gz)
  gzip -dc "$packed" >"$bin/$name" && chmod +x "$bin/$name"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== correctness"
"$bin/gpu_check" "$dir/cases" | tee "$out/gpu_check.txt"
check=${PIPESTATUS[0]}
echo "== toy GPT-MoE on CUDA (200 steps; the loss must fall by at least 1 nat)"
# The working tree's docs and sources as the corpus (the binary's built-in corpus is read from
# the build machine's paths).
cat README.md docs/*.md src/*.rs src/*/*.rs >"$bin/corpus.txt"
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
runs=("cuda threads 1" "cuda-fusion threads 1" "cuda threads 2")
[ "$gpus" -ge 2 ] && runs+=("cuda nccl 2" "cuda-fusion nccl 2")
for run in "${runs[@]}"; do
  read -r backend comm ranks <<<"$run"
  name="train-$backend-$comm-$ranks"
  "$bin/train_gpt_moe" --data "$bin/corpus.txt" --backend "$backend" --comm "$comm" \
    --ranks "$ranks" --steps 200 --eval-every 100 --out "$out/$name" --json >"$out/$name.json"
  status=$?
  python3 - "$out/$name.json" "$name" "$status" <<'PY' || check=1
import json, sys
path, name, status = sys.argv[1], sys.argv[2], int(sys.argv[3])
if status != 0:
    sys.exit(f"{name}: exit {status}")
d = json.load(open(path))
ok = d["train_loss"] < d["initial_loss"] - 1.0
print(f"{name}: loss {d['initial_loss']:.3f} -> {d['train_loss']:.3f} "
      f"(val {d['val_loss']:.3f}), {d['tokens_per_s']:.0f} tokens/s {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
done
echo "== benchmark"
"$bin/gpu_bench" --json "$out/gpu_bench.json" | tee "$out/gpu_bench.txt"
echo "== PyTorch eager peer"
python3 "$dir/torch_gpu_peer.py" --ours "$out/gpu_bench.json" --json "$out/torch_gpu_peer.json" \
  | tee "$out/torch_gpu_peer.txt" || true
exit "$check"
