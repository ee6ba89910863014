//! The publisher conformance suite against the real NATS server, on its own and
//! through the relay and PostgreSQL.

mod common;

use common::NatsTarget;

pgoutbox_core::conformance_tests!(NatsTarget::new().await, |target: NatsTarget| async move {
    target.delete().await
});

pgoutbox_postgres::relay_conformance_tests!(
    NatsTarget::new().await,
    |target: NatsTarget| async move { target.delete().await }
);

pgoutbox_core::conformance_tests!(
    @envelopes NatsTarget::with_envelope,
    |target: NatsTarget| async move { target.delete().await }
);

// WAL mode: events written to the WAL, read from a replication slot.
pgoutbox_postgres::relay_conformance_tests!(
    NatsTarget::new().await,
    |target: NatsTarget| async move { target.delete().await },
    wal
);
