//! The relay's HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use outbox_core::Publisher;
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::broker::AnyPublisher;
use crate::failure::Failure;

#[derive(Clone)]
struct Endpoint {
    metrics: PrometheusHandle,
    pool: PgPool,
    publisher: Arc<AnyPublisher>,
    check_timeout: Duration,
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
    pool: PgPool,
    publisher: Arc<AnyPublisher>,
    check_timeout: Duration,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(Endpoint {
            metrics,
            pool,
            publisher,
            check_timeout,
        });
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

/// Ready when the database answers and the broker is reachable.
async fn ready(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    let limit = endpoint.check_timeout;
    let database = async {
        match tokio::time::timeout(limit, sqlx::query("SELECT 1").execute(&endpoint.pool)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("database: {e}")),
            Err(_) => Err(format!("database: no answer within {limit:?}")),
        }
    };
    let broker = async {
        match tokio::time::timeout(limit, endpoint.publisher.check()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("broker: {e}")),
            Err(_) => Err(format!("broker: no answer within {limit:?}")),
        }
    };
    let (database, broker) = tokio::join!(database, broker);
    let problems: Vec<String> = [database, broker]
        .into_iter()
        .filter_map(Result::err)
        .collect();
    if problems.is_empty() {
        (StatusCode::OK, "ready\n".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", problems.join("; ")),
        )
    }
}
