#!/usr/bin/env bash
# Kernel launches per layer training step on WGPU (Mesa's llvmpipe where there is no GPU),
# counted from cubecl's profiling log: `tools/examples/wgpu_launches.rs` runs at 2 and 3 steps
# with the same seed, and the difference is one step. Prints the count and the last step's
# kernels by name. Any further arguments go to the example (`--top-k 2`, `--partitions 1`, ...).
#
#   scripts/bench/wgpu_launches.sh [ARGS...]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cargo build --quiet --release --manifest-path "$root/Cargo.toml" -p mpipemoe-tools \
    --features probes --example wgpu_launches
bin="$root/target/release/examples/wgpu_launches"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
count() {
    # cubecl reads `cubecl.toml` from the working folder (cubecl-runtime 0.10 `config/base.rs`).
    cat >"$work/cubecl.toml" <<TOML
[profiling.logger]
level = "minimal"
file = "$work/launches-$1.log"
TOML
    (cd "$work" && "$bin" --steps "$1" "${@:2}" 2>/dev/null)
    grep -c "^Executing" "$work/launches-$1.log"
}
two=$(count 2 "$@")
three=$(count 3 "$@")
step=$((three - two))
echo "launches per step: $step (2 steps: $two, 3 steps: $three; args: ${*:-defaults})"
grep "^Executing" "$work/launches-3.log" | tail -n "$step" \
    | sed -e 's/^Executing //' -e 's/ | [A-Za-z]*Runtime.*$//' -e 's/^MatmulEntry.*/MatmulEntry (a matmul)/' \
    | sort | uniq -c | sort -rn
