//! The relay conformance checks can fail: against the in-memory broker of
//! `pgoutbox_core::conformance::memory` (through the real relay and PostgreSQL),
//! `relay_end_to_end` passes with an honest publisher and fails with one that drops
//! the events' headers and with one that delivers an aggregate's events out of
//! order. The checks' real users are the broker crates, against their real brokers.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use pgoutbox_core::conformance::memory::{Fault, MemoryBroker};
use pgoutbox_postgres::conformance;

/// Whether `relay_end_to_end` panics (fails) against a broker with `fault`.
async fn end_to_end_fails(fault: Fault) -> bool {
    let broker = MemoryBroker::new(fault);
    AssertUnwindSafe(conformance::relay_end_to_end(&broker))
        .catch_unwind()
        .await
        .is_err()
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
