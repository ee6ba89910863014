//! The conformance suite's checks can fail: run against the in-memory broker of
//! `conformance::memory`, they pass with an honest publisher and fail with
//! publishers broken on purpose (one that mixes up message bodies within a batch,
//! one that reports a refused message as failed but delivers it a little later). The suite's real users are the broker
//! crates, against their real brokers.

#![cfg(feature = "conformance")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::future::Future;
use std::sync::Arc;

use pgoutbox_core::conformance;
use pgoutbox_core::conformance::memory::{Fault, MemoryBroker};

/// Whether `check` panics (fails) against `broker`.
async fn fails<F, Fut>(broker: MemoryBroker, check: F) -> bool
where
    F: FnOnce(Arc<MemoryBroker>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let run = tokio::spawn(check(Arc::new(broker)));
    match run.await {
        Ok(()) => false,
        Err(e) => e.is_panic(),
    }
}

#[tokio::test]
async fn read_back_fails_when_messages_carry_other_bodies() {
    let check = |b: Arc<MemoryBroker>| async move { conformance::publish_and_read_back(&*b).await };
    assert!(!fails(MemoryBroker::new(Fault::None), check).await);
    assert!(fails(MemoryBroker::new(Fault::RotatesBodies), check).await);
}

#[tokio::test]
async fn refused_message_check_fails_when_it_arrives_late() {
    let check =
        |b: Arc<MemoryBroker>| async move { conformance::refused_message_fails_alone(&*b).await };
    assert!(!fails(MemoryBroker::new(Fault::None), check).await);
    assert!(fails(MemoryBroker::new(Fault::DeliversRefusedLate), check).await);
}

#[tokio::test]
async fn hot_run_checks_pass_on_an_honest_broker() {
    let failure =
        |b: Arc<MemoryBroker>| async move { conformance::hot_run_failure_keeps_order(&*b).await };
    assert!(!fails(MemoryBroker::new(Fault::None), failure).await);
    let outage =
        |b: Arc<MemoryBroker>| async move { conformance::hot_run_outage_keeps_order(&*b).await };
    assert!(!fails(MemoryBroker::new(Fault::None), outage).await);
}
