//! The relay's HTTP endpoint: `/metrics`, `/healthz`, `/readyz`, and the console
//! under `/console/` when enabled.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use pgoutbox_core::{BrokerStatus, Publisher};
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::broker::BrokerPublisher;
use crate::console::Console;
use crate::failure::Failure;
use crate::members::Members;
use crate::wal_slot::SlotWatch;

#[derive(Clone)]
struct Endpoint {
    metrics: PrometheusHandle,
    /// One pool per database.
    pools: Arc<Vec<PgPool>>,
    publisher: BrokerPublisher,
    check_timeout: Duration,
    stuck_after: Duration,
    members: Members,
    wal: Option<SlotWatch>,
}

/// What `/healthz` and `/readyz` look at besides the connections.
pub(crate) struct Probes {
    pub(crate) check_timeout: Duration,
    pub(crate) stuck_after: Duration,
    /// The relays whose claim loops and broker outages are reported.
    pub(crate) members: Members,
    /// WAL mode: the slot, which must be able to carry the outbox's events.
    pub(crate) wal: Option<SlotWatch>,
}

/// Bind now (so a taken port fails the start), serve until `stop` completes.
pub(crate) async fn bind(addr: SocketAddr) -> Result<TcpListener, Failure> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::runtime(format!("cannot listen on {addr} (http.listen): {e}")))
}

/// Serve the endpoints on `listener` until `stop` completes.
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: PrometheusHandle,
    pools: Vec<PgPool>,
    publisher: BrokerPublisher,
    probes: Probes,
    console: Option<Console>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let mut app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .with_state(Endpoint {
            metrics,
            pools: Arc::new(pools),
            publisher,
            check_timeout: probes.check_timeout,
            stuck_after: probes.stuck_after,
            members: probes.members,
            wal: probes.wal,
        });
    if let Some(console) = console {
        app = app.merge(console.router());
    }
    // The client's address goes into the console's audit lines.
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    if let Err(error) = axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
    {
        tracing::error!(%error, "http endpoint failed");
    }
}

async fn render_metrics(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        endpoint.metrics.render(),
    )
}

/// Live unless a claim loop has gone `http.stuck_after` without finishing a cycle
/// (a call that never returns): then only a restart helps. Failing connections
/// do not make the relay dead: its loops keep cycling through their errors, and
/// `/readyz` reports them.
async fn live(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    let now = Instant::now();
    let several = endpoint.members.several();
    let stuck: Vec<String> = endpoint
        .members
        .now()
        .iter()
        .filter_map(|member| {
            let stalled = member.liveness.stalled_for(now)?;
            (stalled > endpoint.stuck_after).then(|| {
                let of = if several {
                    format!("; outbox {}", member.name)
                } else {
                    String::new()
                };
                format!(
                    "stuck: a claim loop has not finished a cycle for {} (http.stuck_after {}{of})",
                    humantime::format_duration(round_to_ms(stalled)),
                    humantime::format_duration(endpoint.stuck_after)
                )
            })
        })
        .collect();
    probe_answer(&stuck, "ok", "", "\n")
}

fn round_to_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Ready when the database answers, the broker is reachable, the relay is not
/// in a broker outage (claiming paused until its probe passes and a message goes
/// through), and in WAL mode the slot can carry the outbox's events (while it
/// cannot, none is read and producers are refused).
async fn ready(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    let limit = endpoint.check_timeout;
    let database = async {
        // A simple query: also answers through a transaction-pooling proxy, where
        // an extended-protocol statement's round trips may meet different servers.
        for pool in endpoint.pools.iter() {
            let select = sqlx::raw_sql("SELECT 1").execute(pool);
            match tokio::time::timeout(limit, select).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("database: {e}")),
                Err(_) => return Err(format!("database: no answer within {limit:?}")),
            }
        }
        Ok(())
    };
    let broker = async {
        match tokio::time::timeout(limit, endpoint.publisher.check()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("broker: {e}")),
            Err(_) => Err(format!("broker: no answer within {limit:?}")),
        }
    };
    let several = endpoint.members.several();
    let outages = endpoint.members.now().into_iter().filter_map(|member| {
        let relay = if several {
            format!("relay of outbox {}", member.name)
        } else {
            "relay".to_string()
        };
        match member.broker_health.status() {
            BrokerStatus::Up => None,
            BrokerStatus::Down { since, reason } => Some(format!(
                "{relay}: broker unavailable for {} ({reason}); claiming paused",
                humantime::format_duration(round_to_ms(since.elapsed()))
            )),
            BrokerStatus::Recovering { since, reason } => Some(format!(
                "{relay}: broker answers again after {} ({reason}); no message through yet",
                humantime::format_duration(round_to_ms(since.elapsed()))
            )),
        }
    });
    let slot = async {
        let Some(wal) = &endpoint.wal else {
            return Ok(());
        };
        match tokio::time::timeout(limit, wal.problem()).await {
            Ok(Ok(None)) => Ok(()),
            Ok(Ok(Some(problem))) => Err(format!("WAL slot: {problem}")),
            Ok(Err(e)) => Err(format!("WAL slot {}: cannot check it: {e}", wal.slot)),
            Err(_) => Err(format!("WAL slot {}: no answer within {limit:?}", wal.slot)),
        }
    };
    let (database, broker, slot) = tokio::join!(database, broker, slot);
    let problems: Vec<String> = [database, broker, slot]
        .into_iter()
        .filter_map(Result::err)
        .chain(outages)
        .collect();
    probe_answer(&problems, "ready", "not ready: ", "; ")
}

/// A probe's answer: `200` and `ok` when there are no `problems`, else `503` and the
/// problems after `prefix`, joined by `separator`; the body ends with a newline.
fn probe_answer(
    problems: &[String],
    ok: &str,
    prefix: &str,
    separator: &str,
) -> (StatusCode, String) {
    if problems.is_empty() {
        (StatusCode::OK, format!("{ok}\n"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{prefix}{}\n", problems.join(separator)),
        )
    }
}
