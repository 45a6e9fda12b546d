#!/usr/bin/env bash
# A flood through the quickstart (in-memory store, the README's first
# command): one address (127.0.0.1) sends `GET /` as fast as 64 connections
# allow (wrk, two threads) while a good client (127.0.0.2) sends one request
# a second within its budget (curl, a new connection each time, its
# `time_total`). Prints refusals per second, what else the flood got, the
# quickstart's CPU per flood request (user and system apart, from
# /proc/PID/stat), and the good client's median and p99 unloaded and during
# the flood.
#
# Both run on this machine's two cores with the quickstart, as a flood from
# one host would: nothing is pinned. The good client's p99 is the
# nearest-rank 99th percentile of SAMPLES requests (100 by default: the
# 99th of 100).
#
#   bash benches/flood.sh                          # the quickstart of this checkout
#   QUICKSTART=path/to/quickstart bash benches/flood.sh   # another build (before/after)
set -euo pipefail
# A relative QUICKSTART is the caller's, not the repository root's.
if [ -n "${QUICKSTART:-}" ]; then
    QUICKSTART=$(realpath "$QUICKSTART")
fi
cd "$(dirname "$0")/.."
SAMPLES=${SAMPLES:-100}
command -v python3 > /dev/null || { echo "flood.sh: needs python3" >&2; exit 1; }
for tool in wrk curl; do
    if ! command -v $tool > /dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $tool > /dev/null
    fi
done
if [ -z "${QUICKSTART:-}" ]; then
    cargo build --quiet --release --example quickstart
    QUICKSTART="${CARGO_TARGET_DIR:-target}/release/examples/quickstart"
fi
PORT=${PORT:-38230}
DIR=$(mktemp -d)
"$QUICKSTART" --addr 127.0.0.1:$PORT > /dev/null 2> "$DIR/quickstart.log" &
QPID=$!
WPID=
trap 'kill $QPID $WPID 2> /dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:$PORT/healthz && break; sleep 0.1; done
if ! curl -s -o /dev/null http://127.0.0.1:$PORT/healthz; then
    echo "flood.sh: the quickstart does not answer on port $PORT:" >&2
    cat "$DIR/quickstart.log" >&2
    exit 1
fi

# good N: one GET / a second from 127.0.0.2 (its budget is 5, refilled one
# a second: every request is admitted), printing status and seconds.
good() {
    for _ in $(seq "$1"); do
        curl -s -o /dev/null --interface 127.0.0.2 -w '%{http_code} %{time_total}\n' \
            http://127.0.0.1:$PORT/
        sleep 1
    done
}
# Milliseconds of the admitted answers; their median and nearest-rank p99.
ms() { awk '$1 == 200 {printf "%.3f\n", $2 * 1000}' | sort -n; }
median() { awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
p99() { awk '{a[NR] = $1} END {i = int(NR * 0.99); if (i < NR * 0.99) i++; print a[i]}'; }

# utime and stime of the quickstart (all its threads), in clock ticks.
ticks() { awk '{print $14, $15}' "/proc/$QPID/stat"; }
quiet=$(good "$SAMPLES")
# Long enough that every flooded sample is taken during the flood (a
# sample takes a second and curl's time, more on saturated cores); checked
# below.
D=$((SAMPLES * 12 / 10 + 5))
read -r u0 s0 < <(ticks)
wrk -t2 -c64 -d"${D}s" http://127.0.0.1:$PORT/ > "$DIR/wrk.txt" &
WPID=$!
sleep 1
flooded=$(good "$SAMPLES")
if ! kill -0 "$WPID" 2> /dev/null; then
    echo "flood.sh: the flood ended before the good client's last sample; raise D" >&2
    exit 1
fi
wait $WPID
read -r u1 s1 < <(ticks)
total=$(awk '/requests in/ {print $1}' "$DIR/wrk.txt")
refused=$(awk '/Non-2xx/ {print $5}' "$DIR/wrk.txt")
errors=$(awk '/Socket errors/ {print}' "$DIR/wrk.txt")
q_ok=$(echo "$quiet" | awk '$1 == 200' | wc -l)
f_ok=$(echo "$flooded" | awk '$1 == 200' | wc -l)
if [ "$q_ok" -ne "$SAMPLES" ] || [ "$f_ok" -ne "$SAMPLES" ]; then
    echo "flood.sh: the good client was not always admitted ($q_ok and $f_ok of $SAMPLES)" >&2
    exit 1
fi
q_med=$(echo "$quiet" | ms | median)
q_p99=$(echo "$quiet" | ms | p99)
f_med=$(echo "$flooded" | ms | median)
f_p99=$(echo "$flooded" | ms | p99)
echo "flood: $total requests in ${D} s from one address, ${refused:-0} refused${errors:+; $errors}"
if [ "${total:-0}" -eq 0 ]; then
    echo "flood.sh: wrk reported no requests" >&2
    exit 1
fi
TCK=$(getconf CLK_TCK)
echo "server_user_cpu_ns_per_flood_request $(( (u1 - u0) * 1000000000 / TCK / total ))"
echo "server_system_cpu_ns_per_flood_request $(( (s1 - s0) * 1000000000 / TCK / total ))"
echo "refused_per_second $(python3 -c "print(round(${refused:-0} / $D))")"
echo "good client unloaded: median $q_med ms, p99 $q_p99 ms ($q_ok/$SAMPLES admitted)"
echo "good client flooded:  median $f_med ms, p99 $f_p99 ms ($f_ok/$SAMPLES admitted)"
echo "good_p99_flooded_vs_unloaded $(python3 -c "print(f'{$f_p99 / $q_p99:.2f}')")"
