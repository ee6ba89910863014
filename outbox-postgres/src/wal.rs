//! The table-less outbox (feature `wal`): events written only to the WAL as
//! transactional logical messages, read back in commit order from a logical
//! replication slot.
//!
//! `pg_logical_emit_message(true, prefix, content)` commits or rolls back with the
//! caller's transaction like a row would, but costs no heap row, no index entry,
//! no claim and no vacuum. The relay reads the messages from a slot with the
//! `pgoutput` plugin (`messages 'true'`) and acknowledges to the slot what the
//! broker took, so a restart resumes from the slot's confirmed position.
//!
//! Pieces:
//! - [`WalMessage`]: the message format (JSON, versioned) and its prefix per outbox;
//! - [`WalOutbox`]: the producer side, `enqueue` in the caller's transaction,
//!   refused (the transaction cannot commit) when no slot of the database would
//!   read the event;
//! - [`slot`]: the slot's name in each database, creating and dropping the slot
//!   and publication, and the check that a slot can carry this database's events,
//!   with a clear error when `wal_level` is not `logical`;
//! - [`WalStream`]: the outbox's events from the slot, in commit order, each with
//!   the LSN to acknowledge once it is published;
//! - [`WalStore`]: the core `Store` over the stream, so the core `Relay` publishes
//!   it; failed events park in the outbox table, which a `PgStore` relay drains.
//!
//! Needs `wal_level = logical` (a server restart; on managed services e.g. RDS's
//! `rds.logical_replication = 1`), a role with `REPLICATION` and a direct
//! connection (a replication session cannot go through a transaction pooler).

mod message;
mod producer;
pub mod slot;
mod store;
mod stream;

pub use message::{WalMessage, FORMAT_VERSION};
pub use producer::WalOutbox;
pub use store::{WalClaim, WalStore};
pub use stream::{WalEvent, WalSource, WalStream, WalStreamError};
