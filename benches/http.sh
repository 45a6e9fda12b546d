#!/usr/bin/env bash
# HTTP overhead of tollgate vs tower_governor over loopback, in one run.
#
# Server (current-thread tokio) pinned to CPU 0, wrk pinned to CPU 1.
# Modes alternate within each round; the table reports medians over rounds
# of requests/s and of server user-CPU nanoseconds per request (utime from
# /proc/PID/stat), and the ratios BENCHMARKS.md asks for.
#
#   bash benches/http.sh            # ROUNDS=5 DURATION=5 CONNS=32 by default
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-5}
CONNS=${CONNS:-32}
if ! command -v wrk > /dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk > /dev/null
fi
cargo build --quiet --release -p tollgate-bench --bin bench_server
BIN="${CARGO_TARGET_DIR:-target}/release/bench_server"
TCK=$(getconf CLK_TCK)
OUT=$(mktemp)
PORT=38100

utime() { awk '{print $14}' "/proc/$1/stat"; }

measure() { # name mode [--refuse]
    local name=$1 mode=$2 flag=${3:-}
    PORT=$((PORT + 1))
    taskset -c 0 "$BIN" --mode "$mode" --addr "127.0.0.1:$PORT" $flag > /dev/null &
    local pid=$!
    for _ in $(seq 100); do
        (echo > "/dev/tcp/127.0.0.1/$PORT") 2> /dev/null && break
        sleep 0.05
    done
    taskset -c 1 wrk -t1 -c"$CONNS" -d1s "http://127.0.0.1:$PORT/" > /dev/null # warm-up
    local t0 t1 report reqs rps
    t0=$(utime "$pid")
    report=$(taskset -c 1 wrk -t1 -c"$CONNS" -d"${DURATION}s" "http://127.0.0.1:$PORT/")
    t1=$(utime "$pid")
    kill "$pid"; wait "$pid" 2> /dev/null || true
    reqs=$(echo "$report" | awk '/requests in/ {print $1}')
    rps=$(echo "$report" | awk '/Requests\/sec/ {print $2}')
    echo "$name $rps $(( (t1 - t0) * 1000000000 / TCK / reqs ))" >> "$OUT"
}

for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS" >&2
    measure bare bare
    measure tollgate tollgate
    measure governor governor
    measure tollgate_refused tollgate --refuse
    measure governor_refused governor --refuse
done

python3 - "$OUT" "$ROUNDS" "$DURATION" "$CONNS" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, rps, cpu = line.split()
    rows.setdefault(name, []).append((float(rps), float(cpu)))
med = {k: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v)) for k, v in rows.items()}
print(f"rounds={sys.argv[2]} duration={sys.argv[3]}s connections={sys.argv[4]}")
print("| configuration | requests/s (median) | server user-CPU ns/request (median) |")
print("|---|---|---|")
for k in ["bare", "tollgate", "governor", "tollgate_refused", "governor_refused"]:
    print(f"| {k} | {med[k][0]:.0f} | {med[k][1]:.0f} |")
added_t = med["tollgate"][1] - med["bare"][1]
added_g = med["governor"][1] - med["bare"][1]
print()
print(f"added CPU per admitted request: tollgate {added_t:.0f} ns, tower_governor {added_g:.0f} ns, ratio {added_t / added_g:.2f} (target <= 0.5)" if added_g > 0 else "tower_governor added no measurable CPU")
print(f"all refused, requests/s vs bare: tollgate {med['tollgate_refused'][0] / med['bare'][0]:.2f} (target >= 0.9), tower_governor {med['governor_refused'][0] / med['bare'][0]:.2f}")
PY
rm -f "$OUT"
