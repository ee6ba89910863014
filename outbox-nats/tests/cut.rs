//! A connection lost while a batch waits for its PubAcks: the batch fails as an
//! outage at once, not after the PubAck timeout, and nothing counts as published.

mod common;

use std::time::{Duration, Instant};

use common::NatsTarget;
use pgoutbox_core::conformance::claimed_event;
use pgoutbox_core::{Outcome, Publisher};
use pgoutbox_nats::async_nats::connection::State;

/// The publisher's PubAck timeout in this test: far longer than the bound below,
/// so that only noticing the cut can end the batch within that bound.
const ACK_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the batch may take once the connection is gone (the publisher looks
/// every 50 ms; the rest is room for a loaded machine).
const FAIL_WITHIN: Duration = Duration::from_secs(20);

#[tokio::test]
async fn a_cut_connection_fails_the_batch_before_the_ack_timeout() {
    let target = NatsTarget::new().await;
    let publisher = target
        .proxied_config()
        .timeout(ACK_TIMEOUT)
        .connect()
        .await
        .expect("connect through the proxy");
    // Connected and published once: the cut below drops a live connection.
    let warm = publisher
        .publish(&[claimed_event("order", "0", "order.created", 0)])
        .await;
    assert!(matches!(warm[..], [Outcome::Published]), "{warm:?}");

    target.proxy.cut();
    let bound = Instant::now() + FAIL_WITHIN;
    while publisher.client().connection_state() != State::Disconnected {
        assert!(Instant::now() < bound, "the client never noticed the cut");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The client buffers what is sent while it has no connection; the PubAcks of
    // these messages cannot come.
    let events: Vec<_> = (1..=20)
        .map(|i| claimed_event("order", &i.to_string(), "order.created", i))
        .collect();
    let started = Instant::now();
    let outcomes = publisher.publish(&events).await;
    let took = started.elapsed();
    target.proxy.restore();

    assert_eq!(outcomes.len(), events.len());
    for outcome in &outcomes {
        assert!(
            matches!(outcome, Outcome::Failed(e) if e.is_unavailable()),
            "every message fails as an outage: {outcome:?}"
        );
    }
    assert!(
        took < FAIL_WITHIN,
        "the batch took {took:?}: it waited for the PubAck timeout ({ACK_TIMEOUT:?})"
    );
    target.delete().await;
}
