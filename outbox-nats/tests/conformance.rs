//! The publisher conformance suite against the real NATS server, on its own and
//! through the relay and PostgreSQL.

mod common;

use common::NatsTarget;

// The publisher suite, and the relay checks in table and WAL mode.
pgoutbox_postgres::broker_conformance_tests!(
    NatsTarget::with_envelope,
    |target: NatsTarget| async move { target.delete().await }
);
