//! The field notes' token-bucket trace, driven through the in-memory store
//! with a manual clock. Run: `cargo run --example budget`.

use std::time::Duration;

use tollgate_budget::{Charge, Key, ManualClock, MemoryStore, Policy, Rate, Verdict};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policy = Policy::token_bucket("export", 3, Rate::per_second(2))?;
    let key = Key::new("export").with("north").with("alice");
    let events = [
        (0, 1),
        (0, 1),
        (0, 1),
        (0, 1),
        (250, 1),
        (500, 1),
        (1500, 2),
        (100_000, 1),
        (100_000, 1),
        (100_000, 1),
        (100_000, 1),
        (200_000, 4),
    ];
    for (ms, cost) in events {
        clock.set(ms * 1_000_000);
        let charge = Charge::new(key.clone(), policy.clone(), cost)?;
        let verdict = store.charge_now(&[charge])?.verdict();
        let shown = match verdict {
            Verdict::Admitted => "allow".to_owned(),
            Verdict::Denied { retry_after } => format!("deny, fits in {retry_after:?}"),
            Verdict::NeverFits => "never fits".to_owned(),
        };
        println!("t={:>7?} cost={cost} {shown}", Duration::from_millis(ms));
    }
    Ok(())
}
