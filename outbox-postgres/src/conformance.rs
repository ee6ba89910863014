//! Publisher conformance through the real relay and the real PostgreSQL store: the
//! checks a broker crate runs besides `pgoutbox_core::conformance_tests!`, with the
//! same [`ConformanceTarget`], as one `#[tokio::test]` each with
//! [`relay_conformance_tests!`](crate::relay_conformance_tests).
//!
//! Not a stable API: checks are added and tightened as the publisher contract grows.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use pgoutbox_core::conformance::{ConformanceTarget, NOT_RECEIVED_WAIT, RECEIVE_TIMEOUT};
use pgoutbox_core::testing::{check_first_arrivals, run_relay_while};
use pgoutbox_core::{NewEvent, Relay, TRACEPARENT};
use uuid::Uuid;

use crate::testing::{broker_relay_config, TestOutbox};

/// Longest a whole check may take.
const DEADLINE: Duration = Duration::from_secs(120);

const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// One `#[tokio::test]` per check of this module, each on a fresh target (the same
/// forms as `pgoutbox_core::conformance_tests!`): `relay_conformance_tests!(make)` or
/// `relay_conformance_tests!(make, cleanup)`. Needs PostgreSQL at `DATABASE_URL`.
#[macro_export]
macro_rules! relay_conformance_tests {
    ($make:expr) => {
        $crate::relay_conformance_tests!($make, |_| async {});
    };
    ($make:expr, $cleanup:expr) => {
        $crate::__core::conformance_tests!(@checks_of $crate; $make, $cleanup; relay_end_to_end);
    };
}

/// Events committed in PostgreSQL transactions reach the broker through the relay:
/// 4 aggregates x 6 events over three transactions, interleaved, each with a
/// `traceparent`; a fourth transaction is rolled back. Every committed event is
/// read back, its header intact, each aggregate's first copies in insertion order;
/// the rolled-back event never arrives; the outbox is empty afterwards.
pub async fn relay_end_to_end<T: ConformanceTarget>(target: &T) {
    let db = TestOutbox::new().await.expect("PostgreSQL at DATABASE_URL");
    let publisher = target.publisher().await.expect("publisher");
    let relay = Relay::new(db.store(), publisher).with_config(broker_relay_config());

    let mut runs: Vec<Vec<Uuid>> = vec![Vec::new(); 4];
    for tx in 0..3 {
        let events: Vec<NewEvent> = (0..8)
            .map(|i| {
                let aggregate = i % 4;
                NewEvent::new(
                    "conformance_order",
                    format!("o-{aggregate}"),
                    "conformance.order.changed",
                    &serde_json::json!({ "tx": tx, "i": i }),
                )
                .with_traceparent(TRACE)
            })
            .collect();
        db.enqueue_committed(&events).await.expect("enqueue");
        for (i, event) in events.iter().enumerate() {
            runs[i % 4].push(event.id);
        }
    }
    let mut tx = db.pool.begin().await.expect("begin");
    let ghost = NewEvent::new(
        "conformance_order",
        "o-0",
        "conformance.order.changed",
        &serde_json::json!({ "rolled back": true }),
    );
    db.outbox.enqueue(&mut tx, &ghost).await.expect("enqueue");
    tx.rollback().await.expect("rollback");

    let wanted: HashSet<Uuid> = runs.iter().flatten().copied().collect();
    let read = async {
        let mut arrivals = Vec::new();
        let mut seen = HashSet::new();
        let deadline = Instant::now() + RECEIVE_TIMEOUT;
        while !wanted.is_subset(&seen) {
            assert!(
                Instant::now() < deadline,
                "relay_end_to_end: {} of {} events read back within {RECEIVE_TIMEOUT:?}",
                wanted.intersection(&seen).count(),
                wanted.len()
            );
            for message in target
                .receive(100, Duration::from_millis(500))
                .await
                .expect("receive")
            {
                if message.id == ghost.id || wanted.contains(&message.id) {
                    assert_eq!(
                        message.headers.get(TRACEPARENT).map(String::as_str),
                        Some(TRACE),
                        "relay_end_to_end: event {} lost its traceparent",
                        message.id
                    );
                    seen.insert(message.id);
                    arrivals.push(message.id);
                }
            }
        }
        // A late copy of the rolled-back event would show up now.
        for message in target
            .receive(100, NOT_RECEIVED_WAIT)
            .await
            .expect("receive")
        {
            arrivals.push(message.id);
        }
        arrivals
    };
    let arrivals = run_relay_while(&relay, read, DEADLINE)
        .await
        .expect("relay_end_to_end: the relay did not stop in time");
    assert!(
        !arrivals.contains(&ghost.id),
        "relay_end_to_end: an event of a rolled-back transaction was published"
    );
    check_first_arrivals(&arrivals, &runs)
        .unwrap_or_else(|e| panic!("relay_end_to_end: per-aggregate order: {e}"));
    let pending = pgoutbox_core::Store::pending(&db.store())
        .await
        .expect("pending");
    assert_eq!(pending, 0, "relay_end_to_end: events left in the outbox");
    db.drop_schema().await.expect("drop schema");
}
