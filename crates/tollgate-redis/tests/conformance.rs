//! The core's conformance table against a real Redis, with injected time,
//! both as one script per request and slot by slot with refunds.

use tollgate_budget::ManualClock;
use tollgate_budget::conformance::{cases, run_case};
use tollgate_redis::RedisStore;
use tollgate_testkit::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_reproduces_every_case() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    for split in [false, true] {
        let clock = ManualClock::new(0);
        let reading = clock.clone();
        let store = RedisStore::builder(&server.url())
            .unwrap()
            .injected_time(move || tollgate_budget::Clock::now(&reading))
            .split_by_slot(split)
            .build()
            .unwrap();
        let memory = tollgate_budget::MemoryStore::builder()
            .clock(clock.clone())
            .build();
        let namespace = if split { "split" } else { "atomic" };
        for case in cases() {
            // Shaping needs one atomic decision: charged slot by slot, a
            // call whose keys span slots is decided unshaped.
            let spans_slots = |case: &tollgate_budget::conformance::Case| {
                case.steps
                    .iter()
                    .any(|s| s.charges.iter().any(|c| c.0 != s.charges[0].0))
            };
            if split && !case.shaped.is_empty() && spans_slots(&case) {
                continue;
            }
            let ours = run_case(&store, namespace, &case, |t| clock.set(t))
                .await
                .unwrap_or_else(|m| panic!("split={split}: {m}"));
            // Beyond the steps the table binds, every value a client sees
            // (remaining, reset, wait, per limit) equals MemoryStore's.
            let reference = run_case(&memory, namespace, &case, |t| clock.set(t))
                .await
                .unwrap_or_else(|m| panic!("memory: {m}"));
            for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
                assert_eq!(a, b, "split={split}: case {} step {i}", case.name);
            }
        }
        // The table's single token-bucket charges ran through the
        // one-bucket script, its plan changes through the full one.
        assert_one_bucket_ran(&store, 20, 1);
    }
}

/// That the one-bucket script decided at least `decided` of a trace's calls
/// and handed at least `handed` to the full script: the trace binds it.
fn assert_one_bucket_ran(store: &RedisStore, decided: u64, handed: u64) {
    let s = store.script_stats();
    assert!(
        s.one_bucket_calls - s.handed_over >= decided && s.handed_over >= handed,
        "{s:?}"
    );
}

/// A Redis store on injected time (charging slot by slot with `split`)
/// and a memory store on the same manual clock, for differential traces.
fn side_by_side(
    server: &RedisServer,
    split: bool,
) -> (ManualClock, RedisStore, tollgate_budget::MemoryStore) {
    let clock = ManualClock::new(0);
    let reading = clock.clone();
    let redis = RedisStore::builder(&server.url())
        .unwrap()
        .injected_time(move || tollgate_budget::Clock::now(&reading))
        .split_by_slot(split)
        .build()
        .unwrap();
    // Never swept: after a clock steps back, a state the memory store has
    // already dropped as idle (idle as of the latest time it saw) decides as
    // no state, while Redis, expiring keys on its own real-time clock, may
    // still hold it. Both never mint credit, but they can answer
    // differently, and which keys share a shard (and so when one is swept)
    // is random per store.
    let memory = tollgate_budget::MemoryStore::builder()
        .clock(clock.clone())
        .sweep_interval(std::time::Duration::from_secs(1 << 40))
        .build();
    (clock, redis, memory)
}

/// Clock faults: the same trace with jumps of up to ten days either way
/// gives the same decisions on Redis (injected time) as in memory (manual
/// clock), so neither mints credit the other would not; and each store's
/// `check` answers what its next charge answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_clock_jumps_agree_with_the_memory_store() {
    use std::time::Duration;
    use tollgate_budget::{Charge, Key, Policy, Rate, Store};
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let (clock, redis, memory) = side_by_side(&server, false);
    let policies = [
        Policy::token_bucket("tb", 7, Rate::new(3, Duration::from_secs(7))).unwrap(),
        Policy::fixed_window("fw", 5, Duration::from_secs(3600)).unwrap(),
        Policy::sliding_window("sw", 5, Duration::from_secs(60)).unwrap(),
    ];
    // A deterministic xorshift trace: jumps up to ±10 days, costs 1..=8.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let day = 86_400_000_000_000i64;
    let mut now: i64 = 20 * day;
    for step in 0..400 {
        let r = next();
        let jump = match r % 4 {
            0 => (r >> 8) as i64 % (10 * day) - 5 * day,
            1 => (r >> 8) as i64 % 10_000_000_000,
            _ => (r >> 8) as i64 % 500_000_000,
        };
        now = (now + jump).clamp(0, 40 * day);
        clock.set(now as u64);
        let p = &policies[(r as usize >> 3) % policies.len()];
        let cost = 1 + (r >> 40) % 8;
        let mut c = vec![Charge::new(Key::new(p.name()).with("k"), p.clone(), cost).unwrap()];
        if r % 5 == 0 {
            // Now and then two limits at once, all-or-nothing.
            let other = &policies[(r as usize >> 5) % policies.len()];
            c.push(Charge::new(Key::new(other.name()).with("k"), other.clone(), 1).unwrap());
        }
        // A check answers what the charge that follows will answer, and
        // changes nothing.
        let checked = (
            memory.check(&c).await.unwrap(),
            redis.check(&c).await.unwrap(),
        );
        let a = memory.charge(&c).await.unwrap();
        let b = redis.charge(&c).await.unwrap();
        assert_eq!(a, b, "step {step}: t={now} policy {} cost {cost}", p.name());
        assert_eq!(
            checked,
            (a.clone(), b),
            "step {step}: check and charge differ"
        );
    }
    assert_one_bucket_ran(&redis, 50, 0);
}

/// Policies whose numbers change under one name (plans, runtime changes):
/// on random traces that switch between token buckets with awkward rates
/// (products past 2^53, the script's exact long arithmetic), fixed and
/// sliding windows, on one key and in multi-charge calls, the script's
/// carry-over gives exactly what `MemoryStore` gives, for every value a
/// client sees, and a check answers what the next charge answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_changes_carry_over_like_the_memory_store() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    for split in [false, true] {
        // Calls charge one key (one slot), so slot by slot is one script
        // too, through the per-slot path.
        let (clock, redis, memory) = side_by_side(&server, split);
        policy_changes_trace(&clock, &redis, &memory, split).await;
        assert_one_bucket_ran(&redis, 50, 500);
    }
}

async fn policy_changes_trace(
    clock: &ManualClock,
    redis: &RedisStore,
    memory: &tollgate_budget::MemoryStore,
    split: bool,
) {
    use std::time::Duration;
    use tollgate_budget::{Charge, Initial, Key, Policy, Rate, Store};
    let name = "plan";
    let policies = [
        Policy::token_bucket(name, 3, Rate::per_second(2)).unwrap(),
        Policy::token_bucket(name, 10, Rate::per_second(5)).unwrap(),
        Policy::token_bucket(name, 7, Rate::new(3, Duration::from_secs(7))).unwrap(),
        Policy::token_bucket(name, 900, Rate::new(11, Duration::from_millis(13))).unwrap(),
        Policy::token_bucket(name, 5, Rate::new(1, Duration::from_nanos(997))).unwrap(),
        Policy::token_bucket(name, 4, Rate::per_second(1))
            .unwrap()
            .with_initial(Initial::Empty),
        Policy::fixed_window(name, 5, Duration::from_secs(60)).unwrap(),
        Policy::fixed_window(name, 2, Duration::from_secs(5)).unwrap(),
        Policy::sliding_window(name, 6, Duration::from_secs(2)).unwrap(),
        Policy::sliding_window(name, 3, Duration::from_secs(9)).unwrap(),
        // Near the script's exact range: a scaled capacity close to 2^53,
        // a limit of 2^53 - 1 over the longest window, 3·l·w near 2^53.
        Policy::token_bucket(name, 3_000_000, Rate::new(3_000, Duration::from_nanos(1))).unwrap(),
        Policy::token_bucket(
            name,
            1_000_000,
            Rate::new(7, Duration::from_nanos(999_999_937)),
        )
        .unwrap(),
        Policy::fixed_window(
            name,
            (1 << 53) - 1,
            Duration::from_nanos(2_000_000_000_000_000),
        )
        .unwrap(),
        Policy::sliding_window(name, 999_999, Duration::from_secs(3)).unwrap(),
    ];
    for p in &policies {
        redis.check_policy(p).unwrap();
    }
    for seed in [
        0x2545_F491_4F6C_DD1D_u64,
        0x9E37_79B9_7F4A_7C15,
        0xD1B5_4A32_D192_ED03,
    ] {
        let mut x: u64 = seed;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut now: i64 = 1_000_000_000_000;
        for step in 0..1500 {
            let r = next();
            let jump = match r % 16 {
                0 | 8 => -((r >> 8) as i64 % 3_000_000_000),
                1 | 9 => (r >> 8) as i64 % 30_000_000_000,
                // Now and then weeks ahead, across the script's eras.
                15 => (r >> 8) as i64 % 5_000_000_000_000_000,
                2 | 3 | 10 | 11 => 0,
                _ => (r >> 8) as i64 % 700_000_000,
            };
            now = (now + jump).max(0);
            clock.set(now as u64);
            let p = &policies[(r as usize >> 3) % policies.len()];
            let cost = 1 + (r >> 40) % 4 + u64::from(r % 13 == 0) * ((r >> 20) % 2_000_000);
            // Keys of their own per seed: every seed's clock starts over.
            let key = format!("{split}-{seed:x}-{}", (r >> 50) % 2);
            let key = key.as_str();
            let mut c = vec![Charge::new(Key::new(name).with(key), p.clone(), cost).unwrap()];
            if r % 7 == 0 {
                // The same key under other numbers in the same call sees the
                // first charge's effect, carried over.
                let other = &policies[(r as usize >> 11) % policies.len()];
                c.push(Charge::new(Key::new(name).with(key), other.clone(), 1).unwrap());
            }
            let checked = (
                memory.check(&c).await.unwrap(),
                redis.check(&c).await.unwrap(),
            );
            let a = memory.charge(&c).await.unwrap();

            let b = redis.charge(&c).await.unwrap();
            assert_eq!(
                a, b,
                "seed {seed:x} step {step}: t={now} policy {p} cost {cost}"
            );
            assert_eq!(
                checked,
                (a.clone(), b),
                "step {step}: check and charge differ"
            );
        }
    }
}

/// Shaping on random traces: shaped and unshaped charges on token buckets
/// with awkward rates, one or two keys per call, requests dropped while
/// they wait, clock jumps: the script reserves and gives back exactly what
/// `MemoryStore` does (every delay, reservation and value a client sees).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shaping_agrees_with_the_memory_store() {
    use std::time::Duration;
    use tollgate_budget::{Charge, Key, Outcome, Policy, Rate, Store};
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let (clock, redis, memory) = side_by_side(&server, false);
    let policies = [
        Policy::token_bucket("two", 2, Rate::per_second(2)).unwrap(),
        Policy::token_bucket("odd", 5, Rate::new(3, Duration::from_secs(7))).unwrap(),
        Policy::token_bucket("fast", 40, Rate::new(7, Duration::from_millis(3))).unwrap(),
        Policy::token_bucket("slow", 3, Rate::new(1, Duration::from_secs(5))).unwrap(),
    ];
    let mut x: u64 = 0x5DEE_CE66_D1CE_4E5B;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut now: u64 = 1_000_000_000;
    // Requests still waiting: their charges, outcome and release time.
    let mut waiting: Vec<(Vec<Charge>, Outcome, u64)> = Vec::new();
    let (mut delayed, mut dropped) = (0, 0);
    for step in 0..2000 {
        let r = next();
        now = match r % 16 {
            0..=6 => now,
            7 | 15 => now + (r >> 8) % 3_000_000_000,
            // Now and then the clock steps back (by up to 1 s) while
            // requests wait: both stores keep the line's order alike.
            14 => now.saturating_sub((r >> 8) % 1_000_000_000),
            _ => now + (r >> 8) % 100_000_000,
        };
        clock.set(now);
        waiting.retain(|w| w.2 > now);
        if r % 5 == 0 && !waiting.is_empty() {
            let (charges, outcome, _) = waiting.swap_remove((r >> 20) as usize % waiting.len());
            let reservation = outcome.reservation().unwrap();
            memory.cancel(&charges, reservation).await.unwrap();
            redis.cancel(&charges, reservation).await.unwrap();
            dropped += 1;
            continue;
        }
        let mut charges = Vec::new();
        for k in 0..1 + (r >> 10) % 2 {
            let p = &policies[((r >> (12 + 3 * k)) % 4) as usize];
            let cost = 1 + (r >> (20 + k)) % 2;
            let mut c =
                Charge::new(Key::new("shape").with(k.to_string()), p.clone(), cost).unwrap();
            if (r >> (30 + k)) % 3 != 0 {
                c = c.shaped(Duration::from_nanos(next() % 3_000_000_000));
            }
            charges.push(c);
        }
        let a = memory.charge(&charges).await.unwrap();
        let b = redis.charge(&charges).await.unwrap();
        assert_eq!(a, b, "step {step}: t={now} {charges:?}");
        if a.reservation().is_some() {
            let release = now + u64::try_from(a.delay().as_nanos()).unwrap();
            waiting.push((charges, a, release));
            delayed += 1;
        }
    }
    assert_one_bucket_ran(&redis, 100, 0);
    // The trace shapes and drops often enough to mean something.
    assert!(
        delayed > 100 && dropped > 30,
        "{delayed} delayed, {dropped} dropped"
    );
}

/// From the second review: what a receipt can settle, and what a shaped
/// call may wait, the same in both stores.
mod settlement {
    use std::time::Duration;

    use tollgate_budget::{Charge, Key, MemoryStore, Outcome, Policy, Rate, Receipt, Store};
    use tollgate_redis::RedisStore;
    use tollgate_testkit::RedisServer;

    const S: u64 = 1_000_000_000;

    async fn both(memory: &MemoryStore, redis: &RedisStore, call: &[Charge]) -> Outcome {
        let m = memory.charge(call).await.unwrap();
        let r = redis.charge(call).await.unwrap();
        assert_eq!(m, r, "the stores disagree on {call:?}");
        m
    }

    async fn refund_both(memory: &MemoryStore, redis: &RedisStore, call: &[Charge], r: &Receipt) {
        memory.refund(call, r).await.unwrap();
        redis.refund(call, r).await.unwrap();
    }

    /// A receipt names reservations: one that names none (made up, from
    /// before any could lapse, or a plain charge's entry) gives nothing
    /// back. Redis gave a plain admission back for a receipt of 0, which
    /// its own undoing of a refused cross-slot call uses (now a mode of
    /// its own), so repeated refunds filled an emptied bucket.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_receipt_that_names_no_reservation_gives_nothing_back() {
        let server = tollgate_testkit::or_skip!(RedisServer::start());
        let (clock, redis, memory) = super::side_by_side(&server, false);
        let hourly = Policy::token_bucket("forged", 3, Rate::per_hour(1)).unwrap();
        let plain = Charge::new(Key::new("k").with("a"), hourly.clone(), 1).unwrap();
        clock.set(1_000 * S);
        for _ in 0..3 {
            assert!(
                both(&memory, &redis, std::slice::from_ref(&plain))
                    .await
                    .is_admitted()
            );
        }
        for made_up in [0, 90 * S, 1_000 * S, Receipt::NOTHING, u64::MAX - 1] {
            let receipt = Receipt::new(vec![made_up]);
            for _ in 0..3 {
                refund_both(&memory, &redis, std::slice::from_ref(&plain), &receipt).await;
            }
        }
        assert!(
            !both(&memory, &redis, std::slice::from_ref(&plain))
                .await
                .is_admitted()
        );
        // A call of a refundable and a plain charge: only the refundable
        // has an entry to settle; refunding the whole call gives back it
        // alone.
        let other = Policy::token_bucket("other", 3, Rate::per_hour(1)).unwrap();
        let call = [
            Charge::new(Key::new("k").with("b"), other.clone(), 1)
                .unwrap()
                .refundable(),
            Charge::new(Key::new("k").with("c"), other, 1).unwrap(),
        ];
        let admitted = both(&memory, &redis, &call).await;
        let receipt = admitted.receipt().unwrap();
        assert_eq!(receipt.windows()[1], Receipt::NOTHING);
        refund_both(&memory, &redis, &call, receipt).await;
        let left = |o: &Outcome, i: usize| match o.limits()[i] {
            d if d.is_admitted() => d.remaining(),
            d => panic!("{d:?}"),
        };
        let again = both(&memory, &redis, &call).await;
        assert_eq!((left(&again, 0), left(&again, 1)), (2, 1));
    }

    /// No shaped charge is held past its own longest wait, also one that
    /// cannot be shaped (a window; a bucket with units reserved) beside one
    /// that can: Redis held such a call 20 s past a 500 ms wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shaped_call_waits_no_longer_than_any_of_its_charges_allows() {
        let server = tollgate_testkit::or_skip!(RedisServer::start());
        let (clock, redis, memory) = super::side_by_side(&server, false);
        clock.set(1_000 * S);
        let slow = Policy::token_bucket("slow", 1, Rate::new(1, Duration::from_secs(20))).unwrap();
        let spend = Charge::new(Key::new("s").with("x"), slow.clone(), 1).unwrap();
        assert!(
            both(&memory, &redis, std::slice::from_ref(&spend))
                .await
                .is_admitted()
        );
        let long = spend.clone().shaped(Duration::from_secs(30));
        let window = Policy::fixed_window("window", 10, Duration::from_secs(60)).unwrap();
        let reserving = Policy::token_bucket("reserving", 10, Rate::per_second(5)).unwrap();
        let reserved = Charge::new(Key::new("r").with("x"), reserving, 1).unwrap();
        assert!(
            both(&memory, &redis, &[reserved.clone().refundable()])
                .await
                .is_admitted()
        );
        let short = Duration::from_millis(500);
        for beside in [
            Charge::new(Key::new("w").with("x"), window, 1)
                .unwrap()
                .shaped(short),
            reserved.shaped(short),
        ] {
            let outcome = both(&memory, &redis, &[beside, long.clone()]).await;
            assert!(!outcome.is_admitted(), "{outcome:?}");
            assert_eq!(outcome.delay(), Duration::ZERO);
        }
        // Alone, the long wait holds the call 20 s.
        let outcome = both(&memory, &redis, std::slice::from_ref(&long)).await;
        assert_eq!(outcome.delay(), Duration::from_secs(20));
    }
}
