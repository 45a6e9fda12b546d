#!/usr/bin/env bash
# Runs every fuzz target for SECONDS_PER_TARGET (default 600) with libFuzzer,
# two at a time, on the stable toolchain, and prints executions and
# findings per target. Seeds live in fuzz/corpus/<target>/seed-*.
#
#   bash fuzz/run.sh                    # 10 minutes per target
#   SECONDS_PER_TARGET=60 bash fuzz/run.sh
#   bash fuzz/run.sh forwarded layer    # only these targets
#
# cargo-fuzz needs unstable rustc flags; RUSTC_BOOTSTRAP=1 lets the stable
# compiler accept them for this build only.
set -euo pipefail
cd "$(dirname "$0")"
T=${SECONDS_PER_TARGET:-600}
command -v cargo-fuzz > /dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
cargo fuzz build -O
LOGS=$(mktemp -d)
run() {
    local target=$1
    mkdir -p "corpus/$target"
    cargo fuzz run -O "$target" "corpus/$target" -- -max_total_time="$T" -print_final_stats=1 -rss_limit_mb=2048 \
        > "$LOGS/$target.log" 2>&1 && echo "$target: ok" || echo "$target: FAILED (see $LOGS/$target.log)"
}
targets=(forwarded retry_after key layer)
if (($# > 0)); then targets=("$@"); fi
for ((i = 0; i < ${#targets[@]}; i += 2)); do
    run "${targets[i]}" &
    if ((i + 1 < ${#targets[@]})); then run "${targets[i + 1]}" & fi
    wait
done
echo "| target | executions | exec/s | crashes, panics, timeouts |"
echo "|---|---|---|---|"
for t in "${targets[@]}"; do
    execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$LOGS/$t.log")
    speed=$(awk '/stat::average_exec_per_sec/ {print $2}' "$LOGS/$t.log")
    found=$(ls artifacts/"$t" 2> /dev/null | wc -l)
    echo "| $t | ${execs:-?} | ${speed:-?} | $found |"
done
