//! The pool a relay's store runs on, built one way by [`relay_pool`], the `outbox`
//! binary, the examples and the benchmarks, so that what is measured is what runs.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// Connect a pool suited to a relay ([`relay_pool_options`]): `max_connections`
/// connections, each with the session settings of [`relay_connect_options`], so
/// that a relay cut off by the network cannot hold its claimed rows for longer
/// than `claim_timeout`. A checkout waits at most 10 s.
pub async fn relay_pool(
    url: &str,
    max_connections: u32,
    claim_timeout: Duration,
) -> Result<PgPool> {
    let options: PgConnectOptions = url
        .parse()
        .map_err(|e: sqlx::Error| Error::InvalidConfig(format!("database URL: {e}")))?;
    Ok(relay_pool_options(max_connections, Duration::from_secs(10))
        .connect_with(relay_connect_options(options, claim_timeout))
        .await?)
}

/// Connection options for a relay's sessions: an
/// `idle_in_transaction_session_timeout` of `claim_timeout`, so that a relay cut
/// off by the network mid-batch cannot hold its claimed rows for longer.
pub fn relay_connect_options(
    options: PgConnectOptions,
    claim_timeout: Duration,
) -> PgConnectOptions {
    let millis = claim_timeout.as_millis().max(1).to_string();
    options.options([("idle_in_transaction_session_timeout", millis.as_str())])
}

/// Pool options for a relay's store: at most `max_connections`, a checkout waits
/// at most `acquire_timeout`.
///
/// Connections are not pinged when taken from the pool (sqlx's default pings each
/// one: a round trip more per claim and per record); a broken one fails its
/// statement, the relay retries after its `error_backoff` and the pool replaces
/// the connection.
pub fn relay_pool_options(max_connections: u32, acquire_timeout: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
}
