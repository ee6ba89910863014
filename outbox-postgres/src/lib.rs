#![doc = include_str!("../README.md")]

mod adopt;
mod cleanup;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
/// The core crate, for `relay_conformance_tests!` (a macro expands in the caller's crate).
#[cfg(feature = "conformance")]
#[doc(hidden)]
pub use pgoutbox_core as __core;
mod dead_letters;
mod enqueue;
mod error;
mod group;
mod ident;
mod inbox;
mod migrate;
#[cfg(feature = "test-utils")]
mod plans;
mod pool;
mod pooler;
mod row;
mod shared_wakeup;
mod shares;
mod sql;
mod stats;
mod store;
mod tables;
#[cfg(feature = "test-utils")]
pub mod testing;
mod wakeup;
#[cfg(feature = "wal")]
#[cfg_attr(docsrs, doc(cfg(feature = "wal")))]
pub mod wal;
mod walk_start;

pub use adopt::{adopt, adoption_plan, AdoptOptions, AdoptionPlan};
pub use cleanup::Cleanup;
pub use dead_letters::DeadLetters;
pub use enqueue::{enqueue, Outbox};
pub use error::{Error, Result};
pub use group::{tenant_schemas, GroupRelay, Member, RelayGroup, TenantDiscovery};
pub use ident::Ident;
pub use inbox::{Inbox, InboxError, Processed};
pub use migrate::{inbox_script, migrate, migrate_inbox, migration_script, unapplied_migrations};
/// The administration types, defined in the core crate (any store can offer them).
pub use pgoutbox_core::admin::{DeadLetter, DeadLetterFilter, OutboxStats};
pub use pool::{relay_connect_options, relay_pool, relay_pool_options};
pub use pooler::pooler_options;
pub use shared_wakeup::SharedWakeup;
pub use sql::AfterDeadLetter;
/// The sqlx this crate is built with (0.8): your transactions must be of the same
/// version to be passed to [`Outbox::enqueue`]; use this one or depend on `sqlx = "0.8"`.
pub use sqlx;
pub use stats::Horizon;
#[cfg(feature = "unstable-internals")]
#[cfg_attr(docsrs, doc(cfg(feature = "unstable-internals")))]
pub use store::ClaimSql;
pub use store::{PgClaim, PgStore, Retention, StoreConfig};
pub use tables::Tables;
pub use wakeup::{install_notify_trigger, remove_notify_trigger, Wakeup};
