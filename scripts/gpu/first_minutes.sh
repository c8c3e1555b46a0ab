#!/usr/bin/env bash
# Where a CUDA process's first minutes go, in one short lease. Runs on the GPU machine from the
# working-tree root after `scripts/gpu/build.sh` staged .gpu/ (carry [".gpu"]):
#   . .gpu/device-env.sh && .gpu/first_minutes.sh
# Three processes side by side, each in a folder of its own so each reads its own `cubecl.toml`
# (cubecl-common 0.10 reads it from the working directory) and logs every kernel compilation and
# autotune result to files of its own: the GPU check, the toy GPT-MoE with cubecl's default
# autotune level, and the toy with `CUBECL_AUTOTUNE_LEVEL=minimal` (cubecl-runtime 0.10
# `config/base.rs`). Compilation is one CPU core's work per process and the machine has 16, so
# side by side they do not slow each other's compilation; the toys' tokens/s are not figures to
# report. Then the benchmark alone. Limits (seconds): SIDE_S (270) for the three, BENCH_S (200);
# TOY_LEVELS picks the toys' autotune levels (one toy each), CASES the folder of cases checked.
# Everything comes back in $OUT/logs.tgz; a summary is printed at the end.
set -uo pipefail
SIDE_S=${SIDE_S:-270}
BENCH_S=${BENCH_S:-200}
TOY_STEPS=${TOY_STEPS:-60}
# The toys' autotune levels (ignored by a build without burn's autotune), and the cases checked.
TOY_LEVELS=${TOY_LEVELS:-balanced minimal}
CASES=${CASES:-}
root="$(pwd)"
dir="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$dir/out}"
mkdir -p "$out"
logs="$(mktemp -d)"
. "$dir/unpack.sh"
cat README.md docs/*.md src/*.rs src/*/*.rs >"$bin/corpus.txt"

# A folder for one process, with a cubecl.toml that logs to $logs/NAME-*.log.
place() {
  local work="$logs/$1.wd"
  mkdir -p "$work"
  cat >"$work/cubecl.toml" <<TOML
[compilation.logger]
level = "basic"
file = "$logs/$1-compile.log"

[autotune.logger]
level = "minimal"
file = "$logs/$1-autotune.log"
TOML
  echo "$work"
}

# Prints one line per second of wall time to NAME-clock.log, so the logs' lines can be placed
# in time by their counts (the loggers write no timestamps).
clock() {
  local name=$1 start=$SECONDS
  while sleep 5; do
    printf '%d s: compile %s, autotune %s\n' $((SECONDS - start)) \
      "$(wc -l <"$logs/$name-compile.log" 2>/dev/null || echo 0)" \
      "$(wc -l <"$logs/$name-autotune.log" 2>/dev/null || echo 0)" >>"$logs/$name-clock.log"
  done
}

toy() {
  local name=$1
  shift
  local work
  work=$(place "$name")
  clock "$name" &
  local ticker=$!
  (cd "$work" && env "$@" timeout "$SIDE_S" "$bin/train_gpt_moe" --data "$bin/corpus.txt" \
    --backend cuda --comm threads --ranks 1 --steps "$TOY_STEPS" --eval-every "$TOY_STEPS" \
    --no-chart --json >"$logs/$name.json" 2>"$logs/$name.err")
  echo "$name: exit $?" >>"$logs/exits.txt"
  kill "$ticker"
}

work=$(place check)
clock check &
check_ticker=$!
(cd "$work" && timeout "$SIDE_S" "$bin/gpu_check" "${CASES:-$dir/cases}" >"$logs/check.txt" 2>&1
  echo "check: exit $?" >>"$logs/exits.txt") &
check_pid=$!
pids=("$check_pid")
for level in $TOY_LEVELS; do
  toy "toy-$level" "CUBECL_AUTOTUNE_LEVEL=$level" &
  pids+=($!)
done
wait "${pids[@]}"
kill "$check_ticker" 2>/dev/null

work=$(place bench)
clock bench &
bench_ticker=$!
(cd "$work" && timeout "$BENCH_S" "$bin/gpu_bench" --quick --json "$logs/gpu_bench.json" \
  >"$logs/bench.txt" 2>"$logs/bench.err")
echo "bench: exit $?" >>"$logs/exits.txt"
kill "$bench_ticker" 2>/dev/null

echo "== exits"
cat "$logs/exits.txt"
echo "== check"
grep -c " ok" "$logs/check.txt" | sed 's/^/ok lines: /'
grep -E "FAIL|passed|f32 matmul|executor" "$logs/check.txt" | head -40
for level in $TOY_LEVELS; do
  name=toy-$level
  echo "== $name"
  tail -c 1500 "$logs/$name.err"
  echo
  cat "$logs/$name.json" 2>/dev/null | head -c 600
  echo
  tail -3 "$logs/$name-clock.log"
done
echo "== bench"
tail -20 "$logs/bench.err"
cat "$logs/bench.txt"
for log in "$logs"/*-compile.log "$logs"/*-autotune.log; do
  [ -f "$log" ] && echo "$(basename "$log"): $(wc -l <"$log") lines"
done
rm -rf "$logs"/*.wd
tar czf "$out/logs.tgz" -C "$logs" .
ls -l "$out"
cd "$root"
