#!/usr/bin/env bash
# HTTP overhead of tollgate vs tower_governor over loopback, in one run
# (tollgate inside the router, as the others, and at the front door:
# around the router, tollgate-front);
# and of tollgate on the quickstart's `POST /export` shape (a principal put
# in by an authentication layer, a per-address and a per-account-operation
# rule) against the same app with the authentication layer alone; and
# the refusal floor (floor-refusal: a copy of the front door's refusal for
# every request, nothing decided), which bounds what any limiter answering
# with that refusal can reach.
#
# Server (current-thread tokio) pinned to CPU 0, wrk pinned to CPU 1.
# Modes alternate within each round; the table reports medians over rounds
# of requests/s, of server user-CPU nanoseconds per request (utime from
# /proc/PID/stat) and of its user+system CPU (utime+stime: the reads, writes
# and polls a response costs in the kernel), and the ratios BENCHMARKS.md
# asks for.
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
# wrk sends GET; the export workload posts with the bearer key the bench's
# stand-in authentication knows (bench_app::EXPORT_AUTHORIZATION).
EXPORT_LUA=$(mktemp --suffix=.lua)
trap 'rm -f "$OUT" "$EXPORT_LUA"' EXIT
cat > "$EXPORT_LUA" <<'LUA'
wrk.method = "POST"
wrk.headers["Authorization"] = "Bearer bench-key"
LUA

utime() { awk '{print $14}' "/proc/$1/stat"; }
cputime() { awk '{print $14 + $15}' "/proc/$1/stat"; }

measure() { # name mode [--refuse]
    local name=$1 mode=$2 flag=${3:-}
    PORT=$((PORT + 1))
    local target=("http://127.0.0.1:$PORT/")
    case $mode in
        *-export) target=(-s "$EXPORT_LUA" "http://127.0.0.1:$PORT/export") ;;
    esac
    taskset -c 0 "$BIN" --mode "$mode" --addr "127.0.0.1:$PORT" $flag > /dev/null &
    local pid=$!
    for _ in $(seq 100); do
        (echo > "/dev/tcp/127.0.0.1/$PORT") 2> /dev/null && break
        sleep 0.05
    done
    taskset -c 1 wrk -t1 -c"$CONNS" -d1s "${target[@]}" > /dev/null # warm-up
    local t0 t1 c0 c1 report reqs rps errors
    t0=$(utime "$pid")
    c0=$(cputime "$pid")
    report=$(taskset -c 1 wrk -t1 -c"$CONNS" -d"${DURATION}s" "${target[@]}")
    t1=$(utime "$pid")
    c1=$(cputime "$pid")
    kill "$pid"; wait "$pid" 2> /dev/null || true
    reqs=$(echo "$report" | awk '/requests in/ {print $1}')
    if [ -z "$reqs" ] || [ "$reqs" -eq 0 ]; then
        echo "http.sh: $name: wrk reported no requests" >&2
        exit 1
    fi
    rps=$(echo "$report" | awk '/Requests\/sec/ {print $2}')
    # A run that answered other than it should (a 401 for a missing
    # header, a refusal where all should pass) measures something else.
    errors=$(echo "$report" | awk '/Non-2xx or 3xx responses/ {print $5}')
    errors=${errors:-0}
    local wrong=0
    if [ -z "$flag" ]; then
        [ "$errors" = 0 ] || wrong=1
    else
        [ $((errors * 100)) -ge $((reqs * 99)) ] || wrong=1
    fi
    if [ "$wrong" = 1 ]; then
        echo "http.sh: $name: $errors of $reqs answered non-2xx" >&2
        exit 1
    fi
    echo "$name $rps $(( (t1 - t0) * 1000000000 / TCK / reqs )) $(( (c1 - c0) * 1000000000 / TCK / reqs ))" >> "$OUT"
}

for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS" >&2
    measure bare bare
    measure tollgate tollgate
    measure governor governor
    measure tollgate_refused tollgate --refuse
    measure tollgate_front tollgate-front
    measure tollgate_front_refused tollgate-front --refuse
    measure governor_refused governor --refuse
    measure bare_export bare-export
    measure tollgate_export tollgate-export
    measure tollgate_export_refused tollgate-export --refuse
    measure floor_refusal floor-refusal --refuse
done

python3 - "$OUT" "$ROUNDS" "$DURATION" "$CONNS" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, rps, cpu, total = line.split()
    rows.setdefault(name, []).append((float(rps), float(cpu), float(total)))
med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in rows.items()}
print(f"rounds={sys.argv[2]} duration={sys.argv[3]}s connections={sys.argv[4]}")
print("| configuration | requests/s (median) | server user-CPU ns/request (median) | server user+system CPU ns/request (median) |")
print("|---|---|---|---|")
for k in ["bare", "tollgate", "governor", "tollgate_refused", "governor_refused", "tollgate_front", "tollgate_front_refused", "bare_export", "tollgate_export", "tollgate_export_refused", "floor_refusal"]:
    print(f"| {k} | {med[k][0]:.0f} | {med[k][1]:.0f} | {med[k][2]:.0f} |")
added_t = med["tollgate"][1] - med["bare"][1]
added_g = med["governor"][1] - med["bare"][1]
print()
print(f"added CPU per admitted request: tollgate {added_t:.0f} ns, tower_governor {added_g:.0f} ns, ratio {added_t / added_g:.2f} (target <= 1.0)" if added_g > 0 else "tower_governor added no measurable CPU")
print(f"all refused, requests/s vs bare: tollgate inside the router {med['tollgate_refused'][0] / med['bare'][0]:.2f}, at the front door {med['tollgate_front_refused'][0] / med['bare'][0]:.2f} (target >= 1.3), tower_governor {med['governor_refused'][0] / med['bare'][0]:.2f}")
print(f"all refused, server user+system CPU per request vs bare: tollgate inside the router {med['tollgate_refused'][2] / med['bare'][2]:.2f}, at the front door {med['tollgate_front_refused'][2] / med['bare'][2]:.2f}, tower_governor {med['governor_refused'][2] / med['bare'][2]:.2f}")
print(f"the refusal floor (a copy of the front door's refusal for every request, nothing decided or rendered), requests/s vs bare: {med['floor_refusal'][0] / med['bare'][0]:.2f}; tollgate's front door vs the floor {med['tollgate_front_refused'][0] / med['floor_refusal'][0]:.2f}")
print(f"all admitted, requests/s vs bare: tollgate inside the router {med['tollgate'][0] / med['bare'][0]:.2f}, at the front door {med['tollgate_front'][0] / med['bare'][0]:.2f} (target >= 0.95), tower_governor {med['governor'][0] / med['bare'][0]:.2f}")
added_e = med["tollgate_export"][1] - med["bare_export"][1]
print(f"/export, 2 rules and a principal: added CPU per admitted request over bare_export: tollgate {added_e:.0f} ns (1 rule on GET /: {added_t:.0f} ns); all refused, requests/s vs bare_export {med['tollgate_export_refused'][0] / med['bare_export'][0]:.2f}, CPU per refused request vs bare_export {med['tollgate_export_refused'][1] / med['bare_export'][1]:.2f}")
PY
