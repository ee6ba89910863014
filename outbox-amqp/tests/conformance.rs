//! The publisher conformance suite against the real RabbitMQ, on its own and
//! through the relay and PostgreSQL.

mod common;

use common::AmqpTarget;

pgoutbox_core::conformance_tests!(AmqpTarget::new().await, |target: AmqpTarget| async move {
    target.delete().await
});

pgoutbox_postgres::relay_conformance_tests!(
    AmqpTarget::new().await,
    |target: AmqpTarget| async move { target.delete().await }
);

pgoutbox_core::conformance_tests!(
    @envelopes AmqpTarget::with_envelope,
    |target: AmqpTarget| async move { target.delete().await }
);

// WAL mode: events written to the WAL, read from a replication slot.
pgoutbox_postgres::relay_conformance_tests!(
    AmqpTarget::new().await,
    |target: AmqpTarget| async move { target.delete().await },
    wal
);
