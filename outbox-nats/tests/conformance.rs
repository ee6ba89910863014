//! The publisher conformance suite against the real NATS server.

mod common;

use common::NatsTarget;

pgoutbox_core::conformance_tests!(NatsTarget::new().await, |target: NatsTarget| async move {
    target.delete().await
});
