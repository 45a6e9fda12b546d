//! Store faults under load, for HARDENING.md: 8 tasks charge one budget of
//! 50 through a RedisStore (timeout 200 ms) while a private redis-server is
//! killed, restarted, paused past the timeout, has its scripts flushed and
//! its memory filled (maxmemory with noeviction). Prints, per phase,
//! requests and outcomes and the worst call latency, and checks that no
//! more than the budget was ever admitted (errors admit nothing: fail closed).
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin fault_drill
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use tollgate::{
    Policy, Rate, RedisStore, Store,
    store::{Charge, Key, StoreErrorKind},
};
use tollgate_testkit::RedisServer;

/// Something done to the server at the start of a phase.
type Fault = Box<dyn Fn(&mut RedisServer)>;

#[derive(Default, Clone, Copy)]
struct Tally {
    requests: u64,
    admitted: u64,
    denied: u64,
    unavailable: u64,
    uncertain: u64,
    worst: Duration,
}

#[tokio::main]
async fn main() -> ExitCode {
    let Some(mut server) = RedisServer::start() else {
        eprintln!("redis-server is required");
        return ExitCode::FAILURE;
    };
    let store = match RedisStore::builder(&server.url())
        .and_then(|b| b.timeout(Duration::from_millis(200)).build())
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(policy) = Policy::token_bucket("drill", 50, Rate::per_hour(1)) else {
        return ExitCode::FAILURE;
    };
    let Ok(charge) = Charge::new(Key::new("drill").with("budget"), policy, 1) else {
        return ExitCode::FAILURE;
    };
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (store, charge, tally, stop) =
                (store.clone(), charge.clone(), tally.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let t0 = Instant::now();
                    let r = store.charge(std::slice::from_ref(&charge)).await;
                    let took = t0.elapsed();
                    let mut t = tally.lock().await;
                    t.requests += 1;
                    t.worst = t.worst.max(took);
                    match r {
                        Ok(o) if o.is_admitted() => t.admitted += 1,
                        Ok(_) => t.denied += 1,
                        Err(e) if e.kind() == StoreErrorKind::Uncertain => t.uncertain += 1,
                        Err(_) => t.unavailable += 1,
                    }
                    drop(t);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        })
        .collect();
    let mut total_admitted = 0;
    println!("| phase | requests | admitted | denied | unavailable | uncertain | worst call |");
    println!("|---|---|---|---|---|---|---|");
    let phases: [(&str, Fault); 8] = [
        ("healthy", Box::new(|_| {})),
        ("killed (SIGKILL)", Box::new(|s| s.kill())),
        ("restarted", Box::new(|s| s.restart())),
        (
            "paused (SIGSTOP) past the timeout",
            Box::new(|s| s.signal("STOP")),
        ),
        ("resumed (SIGCONT)", Box::new(|s| s.signal("CONT"))),
        (
            "SCRIPT FLUSH",
            Box::new(|s| {
                let _ = s.query(&["SCRIPT", "FLUSH"]);
            }),
        ),
        (
            "maxmemory 1, noeviction",
            Box::new(|s| {
                let _ = s.query(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
                let _ = s.query(&["CONFIG", "SET", "maxmemory", "1"]);
            }),
        ),
        (
            "maxmemory lifted",
            Box::new(|s| {
                let _ = s.query(&["CONFIG", "SET", "maxmemory", "0"]);
            }),
        ),
    ];
    for (name, action) in phases {
        action(&mut server);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut t = tally.lock().await;
        let snapshot = *t;
        *t = Tally::default();
        drop(t);
        total_admitted += snapshot.admitted;
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} ms |",
            snapshot.requests,
            snapshot.admitted,
            snapshot.denied,
            snapshot.unavailable,
            snapshot.uncertain,
            snapshot.worst.as_millis()
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    // A restart without persistence forgets the spend: the budget is 50 per
    // life of the Redis data set, so two lives allow at most 100.
    println!(
        "\nadmitted in all: {total_admitted} (budget 50 per Redis data set; the restart lost the first set)"
    );
    if total_admitted <= 100 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
