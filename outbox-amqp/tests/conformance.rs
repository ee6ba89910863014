//! The publisher conformance suite against the real RabbitMQ, on its own and
//! through the relay and PostgreSQL.

mod common;

use common::AmqpTarget;

// The publisher suite, and the relay checks in table and WAL mode.
pgoutbox_postgres::broker_conformance_tests!(
    AmqpTarget::with_envelope,
    |target: AmqpTarget| async move { target.delete().await }
);
