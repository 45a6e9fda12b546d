#!/usr/bin/env bash
# One address floods a quickstart that shares its budgets through Redis
# (`--store redis://`): how many Redis calls the flood costs per refused
# request (INFO commandstats), and a well-behaved client's latency (another
# address, one request a second, curl's time_total) without and with the
# flood, on the same instance.
#
#   bash benches/redis_flood.sh          # FLOOD_SECONDS=12 by default
set -euo pipefail
cd "$(dirname "$0")/.."
D=${FLOOD_SECONDS:-12}
for tool in redis-server wrk curl; do
    command -v $tool > /dev/null || { echo "needs $tool" >&2; exit 1; }
done
cargo build --quiet --release --example quickstart
QS="${CARGO_TARGET_DIR:-target}/release/examples/quickstart"
RPORT=38220
APORT=38221
DIR=$(mktemp -d)
taskset -c 0 redis-server --port $RPORT --bind 127.0.0.1 --save '' --appendonly no --dir "$DIR" > /dev/null &
RPID=$!
for _ in $(seq 50); do redis-cli -p $RPORT ping > /dev/null 2>&1 && break; sleep 0.1; done
"$QS" --addr 127.0.0.1:$APORT --store redis://127.0.0.1:$RPORT > /dev/null 2> "$DIR/quickstart.log" &
QPID=$!
trap 'kill $QPID $RPID 2> /dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 50); do curl -s -o /dev/null http://127.0.0.1:$APORT/healthz && break; sleep 0.1; done
cli() { redis-cli -p $RPORT "$@"; }
calls() { cli INFO commandstats | tr -d '\r' | awk -F'[=,:]' '/^cmdstat_(evalsha|eval):/ {c += $3} END {print c + 0}'; }

# The good client: one GET / a second from 127.0.0.2 (within its budget of
# 5, refilled 1 per second), printing each request's status and seconds.
good() {
    for _ in $(seq "$1"); do
        curl -s -o /dev/null --interface 127.0.0.2 -w '%{http_code} %{time_total}\n' http://127.0.0.1:$APORT/
        sleep 1
    done
}
median() { sort -n | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
worst() { sort -n | tail -1; }

quiet=$(good 10)
cli CONFIG RESETSTAT > /dev/null
wrk -t1 -c32 -d"${D}s" http://127.0.0.1:$APORT/ > "$DIR/wrk.txt" &
WPID=$!
sleep 1
flooded=$(good $((D - 2)))
wait $WPID
flood_calls=$(calls)
total=$(awk '/requests in/ {print $1}' "$DIR/wrk.txt")
refused=$(awk '/Non-2xx/ {print $5}' "$DIR/wrk.txt")
good_ok=$(echo "$flooded" | awk '$1 == 200' | wc -l)
echo "flood: $total requests from one address in ${D} s, $refused refused; Redis script calls during the flood (good client's included): $flood_calls; calls per refused request: $(python3 -c "print(f'{$flood_calls / max(1, $refused):.6f}')")"
echo "good client without flood: median $(echo "$quiet" | awk '{print $2 * 1000}' | median) ms, worst $(echo "$quiet" | awk '{print $2 * 1000}' | worst) ms ($(echo "$quiet" | awk '$1 == 200' | wc -l)/10 admitted)"
echo "good client during flood:  median $(echo "$flooded" | awk '{print $2 * 1000}' | median) ms, worst $(echo "$flooded" | awk '{print $2 * 1000}' | worst) ms ($good_ok/$((D - 2)) admitted)"
