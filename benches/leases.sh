#!/usr/bin/env bash
# In-flight leases (RedisStore as LeaseStore) against a plain INCR/DECR
# semaphore script (benches/semaphore.lua): acquire + release cycles per
# second and latency through redis-rs, and Redis CPU per call from
# redis-benchmark running each script's acquire and release.
#
#   bash benches/leases.sh        # SECONDS_PER_RUN=5 by default
set -euo pipefail
cd "$(dirname "$0")/.."
D=${SECONDS_PER_RUN:-5}
cargo build --quiet --release -p tollgate-bench --bin lease_bench
BENCH="${CARGO_TARGET_DIR:-target}/release/lease_bench"
PORT=38210
source benches/private_redis.sh
LSHA=$(cli SCRIPT LOAD "$(cat crates/tollgate-redis/src/leases.lua)")
SSHA=$(cli SCRIPT LOAD "$(cat benches/semaphore.lua)")
usec_per_call() { cli INFO commandstats | tr -d '\r' | awk -F'[=,]' '/^(cmdstat_evalsha|cmdstat_eval):/ {c += $2; u += $4} END {printf "%.2f", u / c}'; }

echo "| concurrency | leases cycles/s | p50 us | p99 us | Redis us/call | semaphore cycles/s | p50 us | p99 us | Redis us/call | cycles ratio | CPU ratio |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for c in 1 32; do
    cli FLUSHALL > /dev/null; cli CONFIG RESETSTAT > /dev/null
    read -r lrps lp50 lp99 < <(taskset -c 1 "$BENCH" --redis "redis://127.0.0.1:$PORT" --concurrency $c --seconds "$D" --mode lease)
    lcpu=$(usec_per_call)
    cli FLUSHALL > /dev/null; cli CONFIG RESETSTAT > /dev/null
    read -r srps sp50 sp99 < <(taskset -c 1 "$BENCH" --redis "redis://127.0.0.1:$PORT" --concurrency $c --seconds "$D" --mode semaphore)
    scpu=$(usec_per_call)
    echo "| $c | $lrps | $lp50 | $lp99 | $lcpu | $srps | $sp50 | $sp99 | $scpu | $(python3 -c "print(f'{$lrps / $srps:.2f}')") | $(python3 -c "print(f'{$lcpu / $scpu:.2f}')") |"
done

# redis-benchmark, 32 clients: each script's acquire, then its release, on
# 1 000 keys (the lease ids drawn from 1 000 per key, so sets stay small).
rb() { taskset -c 1 redis-benchmark -p $PORT -c 32 -n 200000 -r 1000 --csv "$@" | tail -1 | cut -d, -f2 | tr -d '"'; }
echo
echo "| redis-benchmark, 32 clients | req/s | Redis us/call |"
echo "|---|---|---|"
for op in acquire release; do
    cli CONFIG RESETSTAT > /dev/null
    r=$(rb EVALSHA "$LSHA" 2 "b:{inflight/bench}:all" "b:{inflight/bench}:k:__rand_int__" $op __rand_int__ 10000 0 0)
    echo "| lease $op | $r | $(usec_per_call) |"
done
cli SET "sem:{x}" 0 > /dev/null
for op in acquire release; do
    cli CONFIG RESETSTAT > /dev/null
    r=$(rb EVALSHA "$SSHA" 1 "sem:{__rand_int__}" $op 1000000000)
    echo "| semaphore $op | $r | $(usec_per_call) |"
done
