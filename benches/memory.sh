#!/usr/bin/env bash
# Memory per tracked key (RSS delta in a fresh process), tollgate vs
# governor with IpAddr keys, at 1M and 10M keys; RUNS runs each, medians.
#   bash benches/memory.sh     # RUNS=3 by default
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
cargo build --quiet --release -p tollgate-bench --bin mem_probe
BIN="${CARGO_TARGET_DIR:-target}/release/mem_probe"
OUT=$(mktemp)
for n in 1000000 10000000; do
    for r in $(seq "$RUNS"); do
        for impl in tollgate governor; do
            echo "$n $r $impl" >&2
            "$BIN" "$impl" "$n" | sed "s/^/$n /" >> "$OUT"
        done
    done
done
python3 - "$OUT" <<'PY'
import re, statistics, sys
per_key, idle, after = {}, {}, {}
for line in open(sys.argv[1]):
    n, impl, rest = line.split(" ", 2)
    if rest.split()[0] == n:
        per_key.setdefault((n, impl), []).append(float(rest.split()[1]))
    m = re.search(r"idle_rss_delta_bytes=(\d+)", rest)
    if m:
        idle.setdefault((n, impl), []).append(int(m.group(1)))
    m = re.search(r"after_retain_recent_and_shrink_rss_delta_bytes=(\d+)", rest)
    if m:
        after.setdefault((n, impl), []).append(int(m.group(1)))
print("| keys | tollgate bytes/key | governor bytes/key | ratio | tollgate RSS delta when idle (no user task) | governor when idle (no user task) | governor after retain_recent + shrink_to_fit |")
print("|---|---|---|---|---|---|---|")
for n in ["1000000", "10000000"]:
    t, g = statistics.median(per_key[(n, "tollgate")]), statistics.median(per_key[(n, "governor")])
    ti, gi = statistics.median(idle[(n, "tollgate")]), statistics.median(idle[(n, "governor")])
    ga = statistics.median(after[(n, "governor")])
    print(f"| {int(n):,} | {t:.1f} | {g:.1f} | {t / g:.2f} | {ti / 1e6:.1f} MB | {gi / 1e6:.1f} MB | {ga / 1e6:.1f} MB |")
PY
rm -f "$OUT"
