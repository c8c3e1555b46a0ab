#!/usr/bin/env bash
# Runs on the GPU machine from the working-tree root, after `. .gpu/device-env.sh`:
# (1) every case on CUDA for every strategy and n in {1, 2, 4} (f32 and bf16),
# (2) the toy GPT-MoE trained briefly on CUDA, raw and with fusion (the loss must fall; the
# first step's time since the process started is printed: issue 56's goal is 10 s),
# (3) the forward + backward benchmark (both executors), (4) PyTorch eager's layer on the same
# GPU and shapes, with ours / theirs, (5) the whole models of tests/data/models through
# `mpipemoe logits` / `generate` against transformers' logits and greedy ids, (6) two of them
# fine-tuned on CUDA at two ranks (`mpipemoe finetune`; the loss must fall by 0.5 nat) and the
# written folder loaded by transformers (no missing or unexpected key; logits against ours);
# one table at the end of each.
# Each phase runs under its own time limit (seconds, from the environment), so a lease that ends
# early still returns every earlier phase's log: CHECK_S (default 300), TRAIN_S per training run
# (120), TRAIN_STEPS (200), BENCH_S (240), PEER_S (120, each of the two peer runs), MODELS_S (240),
# FINETUNE_S (240), FTPEER_S (420; phase "finetune-peer", off by default: the 163 M model
# fine-tuned beside transformers, FTPEER_ARGS to scripts/bench/finetune_gpu_peer.py, e.g.
# "--rounds 1 --precision tf32", or "--lora 16" for issue 58's LoRA pair against PEFT), GENPEER_S (300; phase
# "generate-peer", off by default: the 163 M model's greedy generation, one prompt and a batch of 8, ours on
# cuBLAS and on cubecl beside transformers, GENPEER_ARGS to scripts/bench/generate_gpu_peer.py), MEMORY_S (240; phase "memory", off by default: gpu_memory,
# MEMORY_ARGS e.g. "--quick"), PROFILE_S (60 per profiled process; phase "profile", off by default:
# PROFILE_SHAPES, PROFILE_REPEATS), WAKE_S (60; phase "wake", off by default: `gpu_bench
# --wake`, a blocking call to cubecl's device thread after idle gaps, raw and under fusion), AB_S (120 per process; phase "ab", off by default: this
# build's gpu_bench and the one `ALT_REV=REV scripts/gpu/build.sh` staged as gpu_bench-alt,
# alternately, AB_ROUNDS rounds (2) in the order ABBA, with AB_ARGS (default "--quick
# --fusion-pair --repeats 10"); where the alt CLI was staged too (ALT_TOOLS=1), the tiny
# Qwen3-MoE fine-tuned by both CLIs alike, AB_FINETUNE_ARGS (default: 40 steps on
# cuda-fusion); the table from ab_table.py); CHECK_ARGS (e.g. --plan cublas) goes to the check, BENCH_ARGS (e.g. --quick)
# to the benchmark, PEER_ARGS (e.g. --quick --repeats 10) to the PyTorch peer, which runs once
# before the benchmark and once after it (its figures are the two runs' mean, so both sides are
# measured alternately). A phase cut by its limit reports exit 124. PHASES picks the phases
# (default "check models train bench peer"); TRAIN_RUNS replaces the training runs ("BACKEND COMM
# RANKS", joined by ";"). Every process compiles its kernels with NVRTC and autotunes its matmuls afresh: the
# first H200 run spent 96 s on the first case and the toy printed no step within 50 s.
set -uo pipefail
CHECK_S=${CHECK_S:-300}
TRAIN_S=${TRAIN_S:-120}
TRAIN_STEPS=${TRAIN_STEPS:-200}
BENCH_S=${BENCH_S:-240}
PEER_S=${PEER_S:-120}
MODELS_S=${MODELS_S:-240}
FINETUNE_S=${FINETUNE_S:-240}
FTPEER_S=${FTPEER_S:-420}
GENPEER_S=${GENPEER_S:-300}
GENPEER_ARGS=${GENPEER_ARGS:-}
MEMORY_S=${MEMORY_S:-240}
MEMORY_ARGS=${MEMORY_ARGS:-}
FTPEER_ARGS=${FTPEER_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
CHECK_ARGS=${CHECK_ARGS:-}
PEER_ARGS=${PEER_ARGS:-}
PHASES=" ${PHASES:-check models train bench peer} "
check=0
dir="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$dir}"
. "$dir/unpack.sh"
# cubecl reads `cubecl.toml` from the working directory (cubecl-common 0.10 `config/mod.rs`
# `from_current_dir`): each phase logs every kernel compilation and autotune result to files of
# its own under $out, so a slow phase shows whether NVRTC and autotuning spent the time. The
# counts are printed at the end. CUBECL_LOGS=0 turns this off.
cubecl_logs() {
  [ "${CUBECL_LOGS:-1}" = 1 ] || return 0
  cat >cubecl.toml <<TOML
[compilation.logger]
level = "basic"
file = "$out/cubecl-$1-compile.log"

[autotune.logger]
level = "minimal"
file = "$out/cubecl-$1-autotune.log"
TOML
}
# A whole-model pair of scripts/bench (SCRIPT.py, beside transformers on this GPU) under LIMIT
# seconds, with the CLI built here and the phase's arguments; its table, JSON and standard error
# under $out. Usage: whole_model_pair SCRIPT LIMIT [ARGS...]
whole_model_pair() {
  local script=$1 limit=$2
  shift 2
  rm -f cubecl.toml
  timeout "$limit" python3 "scripts/bench/$script.py" --binary "$bin/mpipemoe" "$@" \
    --json "$out/$script.json" 2>"$out/$script.err" | tee "$out/$script.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { check=1; tail -20 "$out/$script.err"; }
}
if [[ $PHASES == *" check "* ]]; then
  echo "== correctness"
  cubecl_logs check
  timeout "$CHECK_S" "$bin/gpu_check" $CHECK_ARGS "$dir/cases" | tee "$out/gpu_check.txt"
  check=${PIPESTATUS[0]}
fi
if [[ $PHASES == *" models "* ]]; then
  echo "== whole models (tests/data/models) on CUDA against transformers"
  rm -f cubecl.toml
  timeout "$MODELS_S" python3 "$dir/models.py" "$bin" "$out" --timeout "$((MODELS_S - 10))" \
    | tee "$out/models.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || check=1
fi
if [[ $PHASES == *" finetune "* ]]; then
  echo "== whole models fine-tuned on CUDA (2 ranks), read back by transformers"
  rm -f cubecl.toml
  for family in mixtral-tiny qwen3-moe-tiny; do
    tuned="$(mktemp -d)/$family"
    timeout "$FINETUNE_S" "$bin/mpipemoe" finetune "tests/data/models/$family" --data docs/architecture.md \
      --steps 100 --batch 4 --seq-len 64 --lr 1e-3 --ranks 2 --backend cuda --out "$tuned" --json \
      >"$out/finetune-$family.json" 2>"$out/finetune-$family.err"
    status=$?
    timeout 120 "$bin/mpipemoe" logits "$tuned" --ids 1,5,9,40,41,42 --backend cuda \
      --out "$tuned.logits.safetensors" >/dev/null 2>>"$out/finetune-$family.err"
    python3 - "$out/finetune-$family.json" "$tuned" "$family" "$status" <<'PY' || check=1
import json, sys
import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM
path, tuned, family, status = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if status != 0:
    sys.exit(f"{family}: finetune exit {status}\n" + open(path[:-5] + ".err").read()[-2000:])
d = json.load(open(path))
model, info = AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.float32, output_loading_info=True)
bad = {k: v for k, v in info.items() if v}
with torch.no_grad():
    ref = model(torch.tensor([[1, 5, 9, 40, 41, 42]])).logits[0].numpy()
ours = load_file(tuned + ".logits.safetensors")["logits"]
err = float(np.abs(ours - ref).max() / np.abs(ref).max())
ok = d["final_loss"] < d["initial_loss"] - 0.5 and not bad and err <= 5e-3
print(f"{family}: loss {d['initial_loss']:.3f} -> {d['final_loss']:.3f} in {d['seconds']:.1f} s "
      f"({d['tokens_per_s']:.0f} tokens/s, median step {d['median_step_s'] * 1e3:.1f} ms); transformers "
      f"loads it ({bad or 'no missing or unexpected key'}), logits vs ours (CUDA) {err:.2e} {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
  done
fi
if [[ $PHASES == *" memory "* ]]; then
  # Issue 56's memory claim on the GPU: the layer's peak device memory, FastMoE-style, PipeMoE
  # and MPipeMoE under each strategy, at the paper's shapes, beside the memory model.
  echo "== device memory against the memory model (gpu_memory)"
  cubecl_logs memory
  timeout "$MEMORY_S" "$bin/gpu_memory" $MEMORY_ARGS --json "$out/gpu_memory.json" | tee "$out/gpu_memory.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || check=1
fi
if [[ $PHASES == *" finetune-peer "* ]]; then
  # Issue 56's whole model on the GPU: the 163 M Qwen3-MoE of BENCHMARKS 13 (written here by
  # transformers, seed 0, on the first run) fine-tuned by `mpipemoe finetune --backend cuda`
  # and by transformers with torch on the same GPU, TF32 on both sides and bf16 on both,
  # alternating processes; tokens/s and peak GPU memory (nvidia-smi, both sides alike).
  echo "== the 163 M Qwen3-MoE fine-tuned on CUDA beside transformers (TF32 both, bf16 both)"
  # shellcheck disable=SC2086 # the arguments split into words on purpose
  whole_model_pair finetune_gpu_peer "$FTPEER_S" $FTPEER_ARGS
fi
if [[ $PHASES == *" generate-peer "* ]]; then
  # Issue 56's whole model on the GPU, generating: greedy new tokens/s of the 163 M Qwen3-MoE,
  # one prompt and a batch of eight, ours with the dense products on cuBLAS (one section a
  # product) and on cubecl's kernels, beside transformers' generate at the same precision.
  echo "== the 163 M Qwen3-MoE generating on CUDA beside transformers"
  # shellcheck disable=SC2086
  whole_model_pair generate_gpu_peer "$GENPEER_S" $GENPEER_ARGS
fi
[[ $PHASES != *" train "* ]] || echo "== toy GPT-MoE on CUDA ($TRAIN_STEPS steps; the loss must fall by at least 1 nat)"
# `--no-chart`: the GPU machines have no TrueType font for the load chart's text (the second
# H200 run's toy trained and then failed on it), and the run checks the training, not the chart.
# The working tree's docs and sources as the corpus (the binary's built-in corpus is read from
# the build machine's paths).
cat README.md docs/*.md src/*.rs src/*/*.rs >"$bin/corpus.txt"
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
runs=("cuda threads 1" "cuda-fusion threads 1" "cuda threads 2")
[ "$gpus" -ge 2 ] && runs+=("cuda nccl 2" "cuda-fusion nccl 2")
[ -z "${TRAIN_RUNS:-}" ] || IFS=";" read -r -a runs <<<"$TRAIN_RUNS"
[[ $PHASES == *" train "* ]] || runs=()
if (( ${#runs[@]} > 0 )) && [ ! -x "$bin/train_gpt_moe" ]; then
  echo "no toy staged (built with TOY=0 or TOOLS=0): the train phase has nothing to run"
  check=1
  runs=()
fi
for run in "${runs[@]}"; do
  read -r backend comm ranks <<<"$run"
  name="train-$backend-$comm-$ranks"
  cubecl_logs "$name"
  timeout "$TRAIN_S" "$bin/train_gpt_moe" --data "$bin/corpus.txt" --backend "$backend" --comm "$comm" \
    --ranks "$ranks" --steps "$TRAIN_STEPS" --eval-every "$((TRAIN_STEPS / 2))" --no-chart --json >"$out/$name.json" 2>"$out/$name.err"
  status=$?
  python3 - "$out/$name.json" "$name" "$status" <<'PY' || check=1
import json, sys
path, name, status = sys.argv[1], sys.argv[2], int(sys.argv[3])
if status != 0:
    err = open(path[:-5] + ".err").read()[-2000:]
    sys.exit(f"{name}: exit {status}\n{err}")
d = json.load(open(path))
ok = d["train_loss"] < d["initial_loss"] - 1.0
first = d.get("first_step_s")
first = f", first step {first:.1f} s after start" if first is not None else ""
print(f"{name}: loss {d['initial_loss']:.3f} -> {d['train_loss']:.3f} "
      f"(val {d['val_loss']:.3f}), {d['tokens_per_s']:.0f} tokens/s{first} {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
done
if [[ $PHASES == *" bench "* ]]; then
if [[ $PHASES == *" peer "* ]]; then
  echo "== PyTorch peer, before ours"
  rm -f cubecl.toml
  timeout "$PEER_S" python3 "$dir/torch_gpu_peer.py" $PEER_ARGS --json "$out/torch_before.json" \
    >"$out/torch_before.txt" 2>&1 || true
  tail -3 "$out/torch_before.txt"
fi
echo "== benchmark"
cubecl_logs bench
bench_started=$SECONDS
timeout "$BENCH_S" "$bin/gpu_bench" $BENCH_ARGS --json "$out/gpu_bench.json" | tee "$out/gpu_bench.txt"
bench_rc=${PIPESTATUS[0]}
# Ended by a signal (a crash in CUPTI's callbacks, which this run is the first to load), not by
# the timeout (124) and with no table written: once more without the call census, in the time
# the phase has left, so the lease still brings the timings back.
if (( bench_rc > 128 )) && [[ ! -s $out/gpu_bench.json ]]; then
  left=$((BENCH_S - (SECONDS - bench_started)))
  echo "gpu_bench ended by signal $((bench_rc - 128)); again without the call census ($left s left)"
  if (( left > 20 )); then
    timeout "$left" "$bin/gpu_bench" $BENCH_ARGS --no-census --json "$out/gpu_bench.json" | tee "$out/gpu_bench.txt"
  fi
fi
fi
if [[ $PHASES == *" wake "* ]]; then
  # Whether cubecl's device thread (and fusion's) sleeps between a step's blocking calls on
  # this machine's CPU, and what waking it costs (`gpu_bench/wake.rs`).
  echo "== device thread wake-up after idle gaps (gpu_bench --wake)"
  rm -f cubecl.toml
  timeout "${WAKE_S:-60}" "$bin/gpu_bench" --wake --json "$out/wake.json" | tee "$out/wake.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || check=1
fi
if [[ $PHASES == *" ab "* ]]; then
  # Two builds side by side in one call (the only fair comparison of two commits' GPU times):
  # each round runs both, the second round in the other order, so that a drift of the card's
  # clocks over the phase weighs on both sides alike.
  echo "== A/B: this build ($(head -1 "$dir/BUILT_AT")) against $(cat "$dir/ALT_BUILT_AT" 2>/dev/null || echo "no alt build")"
  rm -f cubecl.toml
  if [ ! -x "$bin/gpu_bench-alt" ]; then
    echo "no gpu_bench-alt: build with ALT_REV=REV scripts/gpu/build.sh"
    check=1
  else
    ab_args=${AB_ARGS:---quick --fusion-pair --repeats 10}
    ft_args=${AB_FINETUNE_ARGS:---steps 40 --batch 2 --seq-len 32 --backend cuda-fusion}
    for round in $(seq 1 "${AB_ROUNDS:-2}"); do
      sides=(main alt)
      (( round % 2 == 1 )) || sides=(alt main)
      for side in "${sides[@]}"; do
        suffix=""
        [ "$side" = main ] || suffix="-alt"
        # shellcheck disable=SC2086 # the arguments split into words on purpose
        timeout "${AB_S:-120}" "$bin/gpu_bench$suffix" $ab_args --json "$out/ab-bench-$side-$round.json" \
          >"$out/ab-bench-$side-$round.txt" 2>&1 || { check=1; tail -5 "$out/ab-bench-$side-$round.txt"; }
        if [ -x "$bin/mpipemoe-alt" ] && [ -x "$bin/mpipemoe" ]; then
          # shellcheck disable=SC2086
          timeout "${AB_S:-120}" "$bin/mpipemoe$suffix" finetune tests/data/models/qwen3-moe-tiny \
            --data docs/architecture.md $ft_args --out "$(mktemp -d)/tuned" --json \
            >"$out/ab-finetune-$side-$round.json" 2>"$out/ab-finetune-$side-$round.err" \
            || { check=1; tail -5 "$out/ab-finetune-$side-$round.err"; }
        fi
      done
    done
    python3 "$dir/ab_table.py" "$out" | tee "$out/ab.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || check=1
  fi
fi
if [[ $PHASES == *" profile "* ]]; then
  # One configuration per process (the layer at TF32 through cuBLAS, 2 warm-up steps and
  # PROFILE_REPEATS timed ones), first with cubecl's profiling logger at "minimal" (each launch
  # named as it is submitted: the launch count per step, at the bench's speed), then at "basic"
  # (each launch waited for and timed with device events: every cubecl kernel's device time,
  # which, summed and set beside the step's wall time and the cuBLAS experts' time, says how
  # much of the step the device is idle). cubecl-runtime 0.10 `client.rs` `launch_inner`.
  # `--no-census`: the steps the census counts would add to the profiled ones.
  echo "== profile (cubecl launches per layer step, and their device times)"
  for shape in ${PROFILE_SHAPES:-GPT3-S GPT3-XL}; do
    for level in minimal basic; do
      cat >cubecl.toml <<TOML
[profiling.logger]
level = "$level"
file = "$out/profile-$shape-$level.log"
TOML
      timeout "${PROFILE_S:-60}" "$bin/gpu_bench" --quick --layer-only --shape "$shape" --top-k 1 --no-census \
        --repeats "${PROFILE_REPEATS:-3}" 2>&1 | grep "layer cublas" | sed "s/^/$level: /"
    done
  done
  rm -f cubecl.toml
fi
if [[ $PHASES == *" peer "* ]]; then
echo "== PyTorch peer, after ours (figures: the mean of both runs)"
rm -f cubecl.toml
before=()
[ -f "$out/torch_before.json" ] && before=(--before "$out/torch_before.json")
timeout "$PEER_S" python3 "$dir/torch_gpu_peer.py" $PEER_ARGS "${before[@]}" --ours "$out/gpu_bench.json" \
  --json "$out/torch_gpu_peer.json" | tee "$out/torch_gpu_peer.txt" || true
fi
rm -f cubecl.toml
for log in "$out"/cubecl-*.log; do
  [ -f "$log" ] && echo "$(basename "$log"): $(wc -l <"$log") lines"
done
exit "$check"
