//! Connections through a transaction-pooling proxy (PgBouncer `pool_mode =
//! transaction`), which hands each transaction whichever server connection is
//! free: nothing may outlive a transaction on its server connection, and a
//! statement outside a transaction may not span round trips.
//!
//! Two things in sqlx 0.8 break that, and this crate works around both:
//! - With the statement cache off (`statement_cache_capacity(0)`, the usual advice
//!   for a pooler), sqlx still prepares every statement under a name (`sqlx_s_1`,
//!   `sqlx_s_2`, ..., counted per client connection) and never closes it (sqlx
//!   issue 4328, fixed after 0.8.6). Through the proxy the next client whose
//!   transaction lands on that server connection fails with `prepared statement
//!   "sqlx_s_1" already exists`; on a direct connection the names pile up in the
//!   server. On connections without a cache this crate sends its statements
//!   unnamed (`persistent(false)`): the next parse replaces them.
//! - An extended-protocol statement takes two round trips (parse and describe,
//!   then bind and execute), each ending in a sync after which the proxy may switch
//!   server connections. So every statement this crate runs outside a claim is in
//!   a transaction of its own, and the wake-up probe is one simple query.

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};

/// `options` made fit for a transaction-pooling proxy: no prepared statement cache
/// (see the module text: this crate's statements are then unnamed), and without the
/// `extra_float_digits` startup parameter sqlx sends by default, which PgBouncer
/// refuses (`unsupported startup parameter`) unless its `ignore_startup_parameters`
/// lists it. Add no startup `options` either: settings go on the role instead.
///
/// PgBouncer 1.21 and later can also keep prepared statements itself
/// (`max_prepared_statements`); these options work with and without that.
pub fn pooler_options(options: PgConnectOptions) -> PgConnectOptions {
    options.statement_cache_capacity(0).extra_float_digits(None)
}

/// Whether the connections of `pool` keep prepared statements (sqlx's statement
/// cache is on). If not, statements must be sent unnamed (see the module text).
/// sqlx has no getter for the capacity; its URL form of the options carries it.
pub(crate) fn caches_statements(pool: &PgPool) -> bool {
    !pool
        .connect_options()
        .to_url_lossy()
        .query_pairs()
        .any(|(key, value)| key == "statement-cache-capacity" && value == "0")
}
