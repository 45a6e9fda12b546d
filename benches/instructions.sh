#!/usr/bin/env bash
# Instructions per request of the HTTP layer and per decision of the store,
# counted by callgrind: repeatable whatever else the machine is doing.
#
# Every workload runs twice, at LOW and HIGH requests (decisions), and the
# figure is (I(HIGH) - I(LOW)) / (HIGH - LOW), counting only the function
# that does the work (callgrind --toggle-collect, inclusive of all it
# calls): start-up (quanta's calibration, the runtime, building the app
# and the keys) is never counted, and what the first requests alone pay
# (lazy initialisation, the first map slot) is in both runs and drops out.
# Counting only the work matters: quanta's calibration loops for as long
# as the clocks take to agree, so its cost varies by millions of
# instructions from run to run, which a difference does not cancel.
#
# - HTTP (profile_layer, in process, no sockets): `send_requests`, the
#   loop that builds each request, sends it through the app with
#   `oneshot` and reads the status. bare / tollgate / tower_governor on
#   `GET /`, all admitted or all refused (tollgate inside the router,
#   `Router::layer`, as the others; and tollgate-front, the same rule
#   around the router: the front door, where a refusal is answered before
#   axum routes); and the quickstart's
#   `POST /export` shape: bare-export (the stand-in authentication layer
#   that inserts a Principal, no limiter) and tollgate-export (the same
#   plus a per-address and a per-account-operation rule). "added" is over
#   bare for `GET /`, over bare-export for `/export`, so only the
#   limiter's cost is in it.
# - Hot key (profile_hot_key hot, one key, every decision admitted): only
#   the decision, inclusive of what it calls. tollgate:
#   `MemoryStore::charge_now` (its clock read, the key digest, the shard
#   lock, the map probe, the token bucket). governor: `check_key`'s two
#   calls, `measure_and_replace` (the DashMap lookup with its hash, GCRA)
#   and `QuantaClock::now` (its clock read, which charge_now includes).
#   Not counted on either side: the loop and black_box.
#
# Fails (non-zero) if a run does not admit or refuse what it should, or a
# function the counts rely on does not show in its profile.
# The last four lines are, exactly:
#   admitted_added_vs_tower_governor RATIO  (tollgate admitted - bare) / (tower_governor admitted - bare)
#   refused_vs_bare RATIO                   tollgate refused at the front door (around the router) / bare
#   hot_key_instructions_vs_governor RATIO  tollgate per decision / governor per decision
#   refused_inside_router_vs_bare RATIO     tollgate refused inside the router (Router::layer) / bare
#
#   bash benches/instructions.sh        # LOW=20000 HIGH=120000 by default
set -euo pipefail
cd "$(dirname "$0")/.."
LOW=${LOW:-20000}
HIGH=${HIGH:-120000}
if ! command -v valgrind > /dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind > /dev/null
fi
cargo build --quiet --release -p tollgate-bench --bin profile_layer --bin profile_hot_key
# The binaries run from a path of fixed length: the arguments are copied to
# the heap at start, so the length of argv[0] moves every later allocation
# and, with it, the instructions malloc and memcpy take (78 per request on
# bare-export between a relative and an absolute path). The counts then
# agree from one checkout or target directory to another.
WORK=$(mktemp -d /tmp/instructions.XXXXXXXX)
trap 'rm -rf "$WORK"' EXIT
BIN="$WORK/bin"
mkdir "$BIN"
cp "${CARGO_TARGET_DIR:-target}/release/profile_layer" "${CARGO_TARGET_DIR:-target}/release/profile_hot_key" "$BIN/"
RESULTS="$WORK/results"

fail() {
    echo "instructions.sh: $*" >&2
    exit 1
}

# count NAME N EXPECT [valgrind options...] -- COMMAND...: runs COMMAND
# under callgrind, checks that its output contains EXPECT, and prints the
# instructions it counted.
count() {
    local name=$1 n=$2 expect=$3
    shift 3
    local opts=()
    while [ "$1" != "--" ]; do opts+=("$1"); shift; done
    shift
    echo "callgrind: $* ($name, $n)" >&2
    if ! valgrind --tool=callgrind --callgrind-out-file="$WORK/$name.$n.out" "${opts[@]}" \
        "$@" > "$WORK/$name.$n.log" 2> "$WORK/$name.$n.err"; then
        cat "$WORK/$name.$n.log" "$WORK/$name.$n.err" >&2
        fail "$* failed"
    fi
    grep -qxF "$expect" "$WORK/$name.$n.log" ||
        fail "$*: expected \"$expect\", got \"$(cat "$WORK/$name.$n.log")\""
    awk '/^summary:/ {print $2}' "$WORK/$name.$n.out"
}

# require NAME N REGEX: fails unless REGEX names a function in the profile;
# otherwise a toggle matched nothing (an inlined function, say) and the
# count would silently miss what it stands for.
require() {
    grep -qE "^c?fn=.*$3" "$WORK/$1.$2.out" ||
        fail "$1: no function matching /$3/ in the profile; the toggles count something else"
}

# layer NAME MODE [refuse]: both counts of a profile_layer workload.
layer() {
    local name=$1 mode=$2 refuse=${3:-} n admitted refused ir
    for n in "$LOW" "$HIGH"; do
        if [ -n "$refuse" ]; then admitted=1; refused=$((n - 1)); else admitted=$n; refused=0; fi
        # The refusal floor refuses the first request too.
        if [ "$mode" = floor-refusal ]; then admitted=0; refused=$n; fi
        # Not inside echo's arguments: a failure must stop the script.
        ir=$(count "$name" "$n" \
            "$mode${refuse:+ refuse}: $admitted of $n admitted, $refused refused, 0 other" \
            --toggle-collect='profile_layer::send_requests*' \
            -- "$BIN/profile_layer" "$mode" ${refuse:+"$refuse"} "$n")
        require "$name" "$n" 'profile_layer::send_requests(<.*>)?$'
        echo "$name $n $ir" >> "$RESULTS"
    done
}

# hot_key NAME IMPL FUNCTION-REGEX... -- TOGGLES...: both counts of the
# hot-key decision; each FUNCTION-REGEX must name a function in the
# profile (see require).
hot_key() {
    local name=$1 impl=$2 n re ir
    shift 2
    local must=()
    while [ "$1" != "--" ]; do must+=("$1"); shift; done
    shift
    for n in "$LOW" "$HIGH"; do
        ir=$(count "$name" "$n" "$n of $n decisions admitted" "$@" \
            -- "$BIN/profile_hot_key" "$impl" hot "$n")
        echo "$name $n $ir" >> "$RESULTS"
        for re in "${must[@]}"; do require "$name" "$n" "$re"; done
    done
}

layer bare bare
layer tollgate tollgate
layer governor governor
layer tollgate_refused tollgate refuse
layer tollgate_front tollgate-front
layer tollgate_front_refused tollgate-front refuse
layer governor_refused governor refuse
layer bare_export bare-export
layer tollgate_export tollgate-export
layer tollgate_export_refused tollgate-export refuse
layer floor_empty floor-empty
layer floor_refusal floor-refusal refuse
hot_key hot_tollgate tollgate 'MemoryStore.*charge_now' \
    -- --toggle-collect='*MemoryStore*charge_now*'
hot_key hot_governor governor 'measure_and_replace' 'QuantaClock as governor::clock::Clock>::now' \
    -- --toggle-collect='*measure_and_replace*' --toggle-collect='*QuantaClock*now*'

python3 - "$RESULTS" "$LOW" "$HIGH" <<'PY'
import sys
low, high = int(sys.argv[2]), int(sys.argv[3])
counts = {}
for line in open(sys.argv[1]):
    name, n, ir = line.split()
    counts.setdefault(name, {})[int(n)] = int(ir)
per = {name: (c[high] - c[low]) / (high - low) for name, c in counts.items()}
for name, v in per.items():
    if v <= 0:
        sys.exit(f"instructions.sh: {name}: {v} instructions per request; the workload did not run")

def fmt(x):
    return f"{x:,.0f}".replace(",", " ")

print(f"callgrind instructions per request: (I({high}) - I({low})) / {high - low}, I = instructions in profile_layer::send_requests")
print()
print("| workload | instructions/request | added over its bare | ratio to tower_governor's addition |")
print("|---|---|---|---|")
rows = [
    ("bare (GET /)", "bare", None, None),
    ("tollgate, 1 rule, all admitted", "tollgate", "bare", "governor"),
    ("tower_governor, all admitted", "governor", "bare", None),
    ("tollgate, 1 rule, all refused", "tollgate_refused", "bare", "governor_refused"),
    ("tollgate at the front door, 1 rule, all admitted", "tollgate_front", "bare", "governor"),
    ("tollgate at the front door, 1 rule, all refused", "tollgate_front_refused", "bare", "governor_refused"),
    ("tower_governor, all refused", "governor_refused", "bare", None),
    ("bare-export (POST /export, principal middleware)", "bare_export", None, None),
    # tower_governor has no per-account rule: no peer to compare with.
    ("tollgate-export, 2 rules, all admitted", "tollgate_export", "bare_export", None),
    ("tollgate-export, 2 rules, all refused", "tollgate_export_refused", "bare_export", None),
    ("floor: an empty 200, nothing else (the harness)", "floor_empty", None, None),
    ("floor: a copy of the front door's refusal, nothing decided or rendered", "floor_refusal", None, None),
]
for label, name, base, peer in rows:
    added = per[name] - per[base] if base else None
    ratio = added / (per[peer] - per["bare"]) if peer else None
    print(f"| {label} | {fmt(per[name])} | {fmt(added) if base else ''} | {f'{ratio:.2f}' if peer else ''} |")
print()
print("hot-key store decision, per decision (callgrind --toggle-collect, inclusive):")
print("| store | counted | instructions/decision |")
print("|---|---|---|")
print(f"| tollgate | MemoryStore::charge_now (includes its clock read) | {per['hot_tollgate']:.1f} |")
print(f"| governor | measure_and_replace + QuantaClock::now | {per['hot_governor']:.1f} |")
print()
single = per["tollgate"] - per["bare"]
export = per["tollgate_export"] - per["bare_export"]
print(f"added per admitted request: 1 rule {fmt(single)}, /export with 2 rules {fmt(export)} "
      f"({export / single:.2f}x); tower_governor {fmt(per['governor'] - per['bare'])}")
print(f"the refusal floor (any limiter answering with this refusal pays at least this): "
      f"{per['floor_refusal'] / per['bare']:.3f} of bare; tollgate's front-door refusal is "
      f"{fmt(per['tollgate_front_refused'] - per['floor_refusal'])} above it, the 0.6 target leaves "
      f"{fmt(0.6 * per['bare'] - per['floor_refusal'])}")
print(f"admitted_added_vs_tower_governor {single / (per['governor'] - per['bare']):.3f}")
print(f"refused_vs_bare {per['tollgate_front_refused'] / per['bare']:.3f}")
print(f"hot_key_instructions_vs_governor {per['hot_tollgate'] / per['hot_governor']:.3f}")
print(f"refused_inside_router_vs_bare {per['tollgate_refused'] / per['bare']:.3f}")
PY
