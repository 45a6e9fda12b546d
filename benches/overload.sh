#!/usr/bin/env bash
# The overload benchmark (adaptive concurrency, fair share, priorities):
# tollgate's adaptive limit, its fixed limit set 2x too high and 2x too
# low, and tower-resilience-adaptive's AIMD and Vegas, in one run, on one
# simulated processor-sharing backend of capacity 16 (20 ms per request),
# with open-loop Poisson arrivals from a fixed seed. See the header of
# crates/tollgate-bench/src/bin/overload.rs for every definition.
#
# Prints a table per scenario, then (last lines) step_goodput_min,
# step_p99_vs_unloaded_max, noisy_worst_tenant, priority_interactive and
# vs_best_peer_min. Writes the run's CSV files to target/overload/ and the
# pictures to benches/overload/ (overload-<scenario>.svg).
#
#   bash benches/overload.sh              # about 3 minutes of real time
#   QUICK=1 bash benches/overload.sh      # a fifth of the length
#   WAIT_MS=50 bash benches/overload.sh   # tollgate's configurations with a line of 64, 50 ms
#   WAIT_MS=0 bash benches/overload.sh    # no line anywhere (priority has one of 20 ms otherwise)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --release -p tollgate-bench --bin overload --bin overload_plot
BIN="${CARGO_TARGET_DIR:-target}/release"
CSV="${CARGO_TARGET_DIR:-target}/overload"
args=(--csv "$CSV")
if [ -n "${WAIT_MS:-}" ]; then
    args+=(--wait-ms "$WAIT_MS")
fi
if [ -n "${QUICK:-}" ]; then
    args+=(--quick)
fi
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
"$BIN/overload" "${args[@]}" | tee "$OUT" | head -n -6
"$BIN/overload_plot" "$CSV" benches/overload > /dev/null
echo
echo "pictures: benches/overload/overload-{step,noisy,priority}.svg"
echo "machine: $(nproc) cores, $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
tail -n 6 "$OUT"
