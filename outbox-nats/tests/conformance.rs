//! The publisher conformance suite against the real NATS server.

mod common;

use common::NatsTarget;
use outbox_core::conformance;

macro_rules! suite {
    ($($name:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $name() {
            let target = NatsTarget::new().await;
            conformance::$name(&target).await;
            target.delete().await;
        }
    )*};
}

suite!(
    empty_batch,
    publish_and_read_back,
    message_envelope,
    per_aggregate_order,
    republish_is_published,
    refused_message_fails_alone,
    failed_event_holds_back_its_run,
    unreachable_broker_is_unavailable,
);
