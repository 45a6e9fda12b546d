#!/usr/bin/env bash
# RedisStore against redis-benchmark running the same Lua script, and the
# script's Redis CPU per decision against a plain GCRA script, in one run.
# The load is one token-bucket charge per request, which RedisStore sends to
# its one-bucket script (crates/tollgate-redis/src/one_bucket.lua); the full
# decision script (decide.lua: several charges, windows, shaping, and what
# the one-bucket script hands over) is measured on its own line.
#
#   bash benches/redis.sh        # SECONDS_PER_RUN=5 by default
set -euo pipefail
cd "$(dirname "$0")/.."
D=${SECONDS_PER_RUN:-5}
cargo build --quiet --release -p tollgate-bench --bin redis_bench
BENCH="${CARGO_TARGET_DIR:-target}/release/redis_bench"
PORT=38200
source benches/private_redis.sh
# The scripts as RedisStore renders them (the .lua files are templates).
SHA=$(cli SCRIPT LOAD "$("$BENCH" --print-script one-bucket)")
FULL_SHA=$(cli SCRIPT LOAD "$("$BENCH" --print-script decide)")
GSHA=$(cli SCRIPT LOAD "$(cat benches/gcra.lua)")
usec_per_call() { cli INFO commandstats | tr -d '\r' | awk -F'[=,]' '/^cmdstat_evalsha:/ {print $6}'; }
evalsha_calls() { cli INFO commandstats | tr -d '\r' | awk -F'[=,]' '/^cmdstat_evalsha:/ {print $2}'; }
# The numbers RedisStore sends for a 1e6-per-second bucket of 1e6, under its
# key layout. RedisStore packs them as eight little-endian doubles;
# redis-benchmark cannot send binary arguments, so it sends the same numbers
# in the scripts' text form.
KEY="tollgate:{bench:__rand_int__}:bench/requests"
OURS=(EVALSHA "$SHA" 1 "$KEY" "1:1000000000:1:1000:1:1000:0:0")
FULL=(EVALSHA "$FULL_SHA" 1 "$KEY" s 0 0 1767225600 charge "1:1000000000:1:1000:1:1000:0:0")
GCRA=(EVALSHA "$GSHA" 1 "gcra:{bench:__rand_int__}" 1 1000000000000 1)

echo "| concurrency | RedisStore decisions/s | p50 us | p99 us | redis-benchmark same script req/s | ratio | Redis us/call (RedisStore) |"
echo "|---|---|---|---|---|---|---|"
for c in 1 32 128; do
    cli CONFIG RESETSTAT > /dev/null
    read -r rps p50 p99 _ _ < <(taskset -c 1 "$BENCH" --redis "redis://127.0.0.1:$PORT" --concurrency $c --seconds "$D" --mode allow)
    ours_cpu=$(usec_per_call)
    ours_calls=$(evalsha_calls)
    n=$(python3 -c "print(max(20000, int($rps * $D)))")
    rb=$(taskset -c 1 redis-benchmark -p $PORT -c $c -n "$n" -r 10000 --csv "${OURS[@]}" | tail -1 | cut -d, -f2 | tr -d '"')
    echo "| $c | $rps | $p50 | $p99 | $rb | $(python3 -c "print(f'{$rps / $rb:.2f}')") | $ours_cpu |"
    if [ "$c" = 32 ]; then store_cpu=$ours_cpu; store_calls=$ours_calls; store_rps=$rps; fi
done

cli CONFIG RESETSTAT > /dev/null
taskset -c 1 redis-benchmark -p $PORT -c 32 -n 200000 -r 10000 --csv "${OURS[@]}" > /dev/null
text_cpu=$(usec_per_call)
cli CONFIG RESETSTAT > /dev/null
taskset -c 1 redis-benchmark -p $PORT -c 32 -n 200000 -r 10000 --csv "${GCRA[@]}" > /dev/null
gcra_cpu=$(usec_per_call)
cli CONFIG RESETSTAT > /dev/null
taskset -c 1 redis-benchmark -p $PORT -c 32 -n 200000 -r 10000 --csv "${FULL[@]}" > /dev/null
full_cpu=$(usec_per_call)
echo
echo "Redis CPU per decision (INFO commandstats usec_per_call, 32-way): tollgate script as RedisStore sends it (packed) $store_cpu us, plain GCRA script (redis-benchmark) $gcra_cpu us, ratio $(python3 -c "print(f'{$store_cpu / $gcra_cpu:.2f}')") (target <= 1); the same script with text arguments (redis-benchmark) $text_cpu us"
echo "EVALSHA calls per RedisStore decision (32-way): $(python3 -c "print(f'{$store_calls / ($store_rps * $D):.2f}')") (1.00: none handed to the full script); the full decision script on the same charge (text arguments, redis-benchmark) $full_cpu us, ratio to GCRA $(python3 -c "print(f'{$full_cpu / $gcra_cpu:.2f}')")"

read -r plain _ _ _ _ < <(taskset -c 1 "$BENCH" --redis "redis://127.0.0.1:$PORT" --concurrency 32 --seconds "$D" --mode deny)
read -r cached _ _ _ hits < <(taskset -c 1 "$BENCH" --redis "redis://127.0.0.1:$PORT" --concurrency 32 --seconds "$D" --mode deny --cache)
echo "deny-heavy (one exhausted key, 32 tasks): without cache $plain decisions/s, with over-limit cache $cached decisions/s ($hits served locally), ratio $(python3 -c "print(f'{$cached / $plain:.1f}')") (target >= 2)"
