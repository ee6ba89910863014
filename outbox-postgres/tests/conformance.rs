//! The relay conformance checks can fail: against the in-memory broker of
//! `pgoutbox_core::conformance::memory` (through the real relay and PostgreSQL),
//! `relay_end_to_end` passes with an honest publisher and fails with one that drops
//! the events' headers and with one that delivers an aggregate's events out of
//! order; `relay_refused_event_is_a_dead_letter_alone` fails with one that reports
//! a refused message as failed but delivers it later; `relay_outage_loses_nothing` passes with an honest publisher and fails
//! with one that reports an outage as failing messages. The checks' real users are the broker crates, against their real brokers.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use pgoutbox_core::conformance::memory::{Fault, MemoryBroker};
use pgoutbox_postgres::conformance;

/// Whether `check` panics (fails).
async fn fails(check: impl std::future::Future<Output = ()>) -> bool {
    AssertUnwindSafe(check).catch_unwind().await.is_err()
}

/// Whether `relay_end_to_end` fails against a broker with `fault`.
async fn end_to_end_fails(fault: Fault) -> bool {
    fails(conformance::relay_end_to_end(&MemoryBroker::new(fault))).await
}

#[tokio::test(flavor = "multi_thread")]
async fn relay_end_to_end_fails_on_lost_headers_and_on_reordering() {
    assert!(!end_to_end_fails(Fault::None).await, "honest broker");
    assert!(end_to_end_fails(Fault::DropsHeaders).await, "lost headers");
    assert!(
        end_to_end_fails(Fault::DelaysOddBatchHeads).await,
        "an aggregate's events out of order"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn relay_outage_check_fails_when_an_outage_looks_like_failing_messages() {
    let honest = MemoryBroker::new(Fault::None);
    assert!(!fails(conformance::relay_outage_loses_nothing(&honest)).await);
    let hiding = MemoryBroker::new(Fault::HidesOutages);
    assert!(fails(conformance::relay_outage_loses_nothing(&hiding)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn relay_refused_check_fails_when_the_refused_message_arrives_late() {
    let honest = MemoryBroker::new(Fault::None);
    assert!(
        !fails(conformance::relay_refused_event_is_a_dead_letter_alone(
            &honest
        ))
        .await
    );
    let late = MemoryBroker::new(Fault::DeliversRefusedLate);
    assert!(
        fails(conformance::relay_refused_event_is_a_dead_letter_alone(
            &late
        ))
        .await
    );
}
