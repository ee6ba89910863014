//! The publisher conformance suite against the real RabbitMQ.

mod common;

use common::AmqpTarget;

pgoutbox_core::conformance_tests!(AmqpTarget::new().await, |target: AmqpTarget| async move {
    target.delete().await
});
