//! The operator console under `/console/` on the `[http]` listener: each outbox's
//! backlog, rates, dead letters and relays, the last hour of backlog and lag, and
//! the dead letters to inspect, retry or purge.
//!
//! The page and its script are embedded in the binary (no build step, nothing
//! fetched from elsewhere). The page builds its DOM with `textContent` only and is
//! served with a Content-Security-Policy that allows no inline script, so an
//! event's payload or error holding markup shows as text. Reading needs nothing;
//! changing dead letters needs the token of `console.token_file` in an
//! `Authorization: Bearer` header, which a page of another origin cannot send
//! (no cookie is involved, so there is nothing to forge).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use pgoutbox_core::{BrokerStatus, DeadLetter, DeadLetterAdmin, DeadLetterFilter};
use pgoutbox_postgres::{DeadLetters, Member};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;
use uuid::Uuid;

use crate::config::ConsoleSettings;
use crate::dead_letters::{self, Change};
use crate::failure::Failure;
use crate::history::History;
use crate::members::Members;
use crate::scrape;
use crate::wal_slot::SlotWatch;

/// Dead letters one listing returns at most.
const MAX_LISTED: u32 = 500;
/// How long one outbox's database reads may take before the page shows an error
/// for it instead of waiting.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

const INDEX_HTML: &str = include_str!("../console/index.html");
const CONSOLE_JS: &str = include_str!("../console/console.js");
const CONSOLE_CSS: &str = include_str!("../console/console.css");

/// No script but the console's own file, no inline script or style, nothing
/// loaded from elsewhere, no framing.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// A console that cannot start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConsoleError {
    /// `console.token_file` cannot be read.
    #[error("console.token_file {0}")]
    Token(#[from] pgoutbox_core::SecretFileError),
}

impl From<ConsoleError> for Failure {
    fn from(error: ConsoleError) -> Self {
        Failure::config(error.to_string())
    }
}

/// What the console reads and acts on.
#[derive(Clone)]
pub(crate) struct Console {
    members: Members,
    wal: Option<SlotWatch>,
    history: History,
    /// `None`: read-only.
    token: Option<Arc<str>>,
}

impl Console {
    /// The console of `members`; reads the token file now.
    pub(crate) fn new(
        settings: &ConsoleSettings,
        members: Members,
        wal: Option<SlotWatch>,
        history: History,
    ) -> Result<Self, ConsoleError> {
        let token = match &settings.token_file {
            Some(path) => Some(Arc::from(pgoutbox_core::read_secret_file(path)?)),
            None => None,
        };
        Ok(Self {
            members,
            wal,
            history,
            token,
        })
    }

    /// Whether actions are possible (a token is configured).
    pub(crate) fn writable(&self) -> bool {
        self.token.is_some()
    }

    /// The console's routes, under `/console`.
    pub(crate) fn router(self) -> Router {
        Router::new()
            .route(
                "/console",
                get(|| async { Redirect::permanent("/console/") }),
            )
            .route(
                "/console/",
                get(|| async { asset(INDEX_HTML, "text/html") }),
            )
            .route(
                "/console/console.js",
                get(|| async { asset(CONSOLE_JS, "text/javascript") }),
            )
            .route(
                "/console/console.css",
                get(|| async { asset(CONSOLE_CSS, "text/css") }),
            )
            .route("/console/api/overview", get(overview))
            .route("/console/api/history", get(history))
            .route("/console/api/dead-letters", get(list))
            .route("/console/api/dead-letter", get(show))
            .route("/console/api/dead-letters/{action}", post(change))
            .with_state(self)
    }
}

/// Sample the relay's metrics into `history` every `interval` until `stop`.
pub(crate) async fn sample(
    metrics: PrometheusHandle,
    history: History,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let readings = scrape::read(&metrics.render());
        history.record(
            Instant::now(),
            chrono::Utc::now().timestamp_millis(),
            readings,
        );
        tokio::select! {
            _ = stop.wait_for(|stopped| *stopped) => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

fn asset(body: &'static str, kind: &'static str) -> Response {
    let mut response = (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_str(&format!("{kind}; charset=utf-8"))
                .unwrap_or(HeaderValue::from_static("text/plain")),
        )],
        body,
    )
        .into_response();
    protect(response.headers_mut());
    response
}

/// Headers of every console response: the policy above, no sniffing, no caching of
/// what may hold event data, no referrer.
fn protect(headers: &mut HeaderMap) {
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
}

/// `value` as a JSON response.
fn answer(status: StatusCode, value: &Value) -> Response {
    let mut response = (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response();
    protect(response.headers_mut());
    response
}

fn problem(status: StatusCode, message: impl Into<String>) -> Response {
    answer(status, &json!({ "error": redact(&message.into()) }))
}

/// `text` with the password of every URL in it replaced (an error may quote the
/// URL it failed to reach).
fn redact(text: &str) -> String {
    text.split_inclusive(char::is_whitespace)
        .map(|word| {
            if word.contains("://") {
                pgoutbox_core::redact_url(word)
            } else {
                word.to_string()
            }
        })
        .collect()
}

async fn overview(State(console): State<Console>) -> Response {
    let members = console.members.now();
    let tenants = console.members.tenant_names();
    let mut outboxes = Vec::with_capacity(members.len());
    for member in &members {
        let mut row = outbox_row(&console, member).await;
        row["kind"] = json!(if tenants.contains(&member.name) {
            "tenant"
        } else {
            "outbox"
        });
        outboxes.push(row);
    }
    answer(
        StatusCode::OK,
        &json!({
            "writable": console.writable(),
            "outboxes": outboxes,
        }),
    )
}

/// One outbox's line of the overview.
async fn outbox_row(console: &Console, member: &Member) -> Value {
    let latest = console.history.latest(&member.name);
    let broker = match member.broker_health.status() {
        BrokerStatus::Up => json!({ "status": "up" }),
        BrokerStatus::Down { since, reason } => json!({
            "status": "down",
            "for_seconds": since.elapsed().as_secs_f64(),
            "reason": redact(&reason),
        }),
        BrokerStatus::Recovering { since, reason } => json!({
            "status": "recovering",
            "for_seconds": since.elapsed().as_secs_f64(),
            "reason": redact(&reason),
        }),
    };
    let stalled = member
        .liveness
        .stalled_for(Instant::now())
        .map(|d| d.as_secs_f64());
    let share = member
        .store
        .share()
        .map(|(index, count)| json!({ "index": index, "count": count }));
    let mut row = json!({
        "name": member.name,
        "published_per_second": latest.map(|p| p.published_per_second),
        "failures_per_second": latest.map(|p| p.failures_per_second),
        "lag_seconds": latest.and_then(|p| p.lag_seconds),
        "broker": broker,
        "relay": { "stalled_seconds": stalled, "share": share },
    });
    match tokio::time::timeout(READ_TIMEOUT, member.store.stats()).await {
        Ok(Ok(stats)) => {
            row["pending"] = json!(stats.pending);
            row["scheduled"] = json!(stats.scheduled);
            row["dead_letters"] = json!(stats.dead_letters);
            row["held_aggregates"] = json!(stats.held_aggregates);
            row["oldest_pending_age_seconds"] = json!(stats.oldest_pending_age.as_secs_f64());
        }
        Ok(Err(error)) => row["error"] = json!(redact(&error.to_string())),
        Err(_) => row["error"] = json!(format!("no answer within {READ_TIMEOUT:?}")),
    }
    if let Some(wal) = console.wal.as_ref().filter(|w| w.outbox == member.name) {
        row["wal"] = json!({ "slot": wal.slot.as_str(), "usable": wal.usable() });
    }
    row
}

async fn history(State(console): State<Console>) -> Response {
    let series: BTreeMap<String, _> = console.history.series();
    answer(
        StatusCode::OK,
        &json!({ "span_seconds": crate::history::SPAN.as_secs(), "outboxes": series }),
    )
}

/// The filters of a listing or a change, as query parameters or JSON fields.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Selection {
    /// One outbox by name; default: every outbox.
    outbox: Option<String>,
    event_type: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    /// Text the last error contains.
    error: Option<String>,
    /// Dead-lettered longer ago than this: `10m`, `2h`, `7d`.
    older_than: Option<String>,
    ids: Option<Vec<Uuid>>,
    /// Listing: at most this many per outbox.
    limit: Option<u32>,
    /// Listing of one outbox: the page after this dead letter.
    after: Option<Uuid>,
    /// Change: count what would change, change nothing.
    dry_run: bool,
}

impl Selection {
    fn filter(&self) -> Result<DeadLetterFilter, String> {
        fn text(v: &Option<String>) -> Option<&str> {
            v.as_deref().map(str::trim).filter(|v| !v.is_empty())
        }
        let mut filter = DeadLetterFilter::default();
        filter.event_type = text(&self.event_type).map(String::from);
        filter.aggregate_type = text(&self.aggregate_type).map(String::from);
        filter.aggregate_id = text(&self.aggregate_id).map(String::from);
        filter.error_contains = text(&self.error).map(String::from);
        filter.older_than = match text(&self.older_than) {
            Some(age) => Some(
                crate::config::parse_duration(age)
                    .map_err(|e| format!("older_than `{age}`: {e}"))?,
            ),
            None => None,
        };
        filter.ids = self.ids.clone().filter(|ids| !ids.is_empty());
        Ok(filter)
    }

    /// The outboxes it applies to; an unknown name is an error.
    fn members(&self, console: &Console) -> Result<Vec<Member>, String> {
        let all = console.members.now();
        match self.outbox.as_deref().filter(|o| !o.is_empty()) {
            None => Ok(all),
            Some(name) => {
                let chosen: Vec<Member> = all.into_iter().filter(|m| m.name == name).collect();
                if chosen.is_empty() {
                    Err(format!("no outbox named `{name}`"))
                } else {
                    Ok(chosen)
                }
            }
        }
    }
}

fn admin_of(member: &Member) -> DeadLetters {
    DeadLetters::new(member.store.pool().clone(), member.store.outbox())
}

async fn list(State(console): State<Console>, Query(selection): Query<Selection>) -> Response {
    let (filter, members) = match selection
        .filter()
        .and_then(|f| Ok((f, selection.members(&console)?)))
    {
        Ok(chosen) => chosen,
        Err(message) => return problem(StatusCode::BAD_REQUEST, message),
    };
    if selection.after.is_some() && members.len() != 1 {
        return problem(
            StatusCode::BAD_REQUEST,
            "`after` pages through one outbox: name it with `outbox`",
        );
    }
    let limit = selection.limit.unwrap_or(100).clamp(1, MAX_LISTED);
    let mut outboxes = Vec::new();
    for member in &members {
        let admin = admin_of(member);
        let read = async {
            let total = DeadLetterAdmin::count(&admin, &filter).await?;
            let letters = admin.list_after(&filter, selection.after, limit).await;
            Ok::<_, pgoutbox_core::StoreError>((
                total,
                letters.map_err(pgoutbox_core::StoreError::backend)?,
            ))
        };
        match tokio::time::timeout(READ_TIMEOUT, read).await {
            Ok(Ok((total, letters))) => outboxes.push(json!({
                "outbox": member.name,
                "total": total,
                // A full page may have a next one: it starts after its last.
                "next_after": (letters.len() == limit as usize)
                    .then(|| letters.last().map(|l| l.event.id))
                    .flatten(),
                "letters": letters.iter().map(|l| letter_json(l, false)).collect::<Vec<_>>(),
            })),
            Ok(Err(error)) => {
                return problem(
                    StatusCode::BAD_GATEWAY,
                    format!("outbox {}: {error}", member.name),
                )
            }
            Err(_) => {
                return problem(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("outbox {}: no answer within {READ_TIMEOUT:?}", member.name),
                )
            }
        }
    }
    answer(StatusCode::OK, &json!({ "outboxes": outboxes }))
}

/// A dead letter for the page; `whole` adds its headers and payload.
fn letter_json(letter: &DeadLetter, whole: bool) -> Value {
    let e = &letter.event;
    let mut value = json!({
        "id": e.id,
        "event_type": e.event_type,
        "aggregate_type": e.aggregate_type,
        "aggregate_id": e.aggregate_id,
        "attempts": e.attempts,
        "created_at": e.created_at,
        "dead_at": letter.dead_at,
        "destination": e.destination,
        "last_error": letter.last_error.as_deref().map(redact),
    });
    if whole {
        // Pretty-printed here, so the page shows it as it is: text.
        let payload = serde_json::from_str::<Value>(e.payload.get())
            .and_then(|v| serde_json::to_string_pretty(&v))
            .unwrap_or_else(|_| e.payload.get().to_string());
        value["payload"] = json!(payload);
        value["headers"] = serde_json::to_value(&e.headers).unwrap_or(Value::Null);
    }
    value
}

#[derive(Debug, Deserialize)]
struct Which {
    outbox: String,
    id: Uuid,
}

async fn show(State(console): State<Console>, Query(which): Query<Which>) -> Response {
    let Some(member) = console
        .members
        .now()
        .into_iter()
        .find(|m| m.name == which.outbox)
    else {
        return problem(
            StatusCode::NOT_FOUND,
            format!("no outbox named `{}`", which.outbox),
        );
    };
    match tokio::time::timeout(READ_TIMEOUT, admin_of(&member).show(which.id)).await {
        Ok(Ok(Some(letter))) => {
            let mut value = letter_json(&letter, true);
            value["outbox"] = json!(member.name);
            answer(StatusCode::OK, &value)
        }
        Ok(Ok(None)) => problem(
            StatusCode::NOT_FOUND,
            format!("no dead letter {} in outbox {}", which.id, member.name),
        ),
        Ok(Err(error)) => problem(StatusCode::BAD_GATEWAY, error.to_string()),
        Err(_) => problem(
            StatusCode::GATEWAY_TIMEOUT,
            format!("no answer within {READ_TIMEOUT:?}"),
        ),
    }
}

/// Whether `presented` is the token, in time independent of where they differ.
fn same_token(presented: &[u8], token: &[u8]) -> bool {
    if presented.len() != token.len() {
        return false;
    }
    presented
        .iter()
        .zip(token)
        .fold(0u8, |diff, (a, b)| diff | (a ^ b))
        == 0
}

/// `None` when the request carries the token; else the refusal.
fn refusal(console: &Console, headers: &HeaderMap) -> Option<Response> {
    let Some(token) = &console.token else {
        return Some(problem(
            StatusCode::FORBIDDEN,
            "the console is read-only: set console.token_file to allow retry and purge",
        ));
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match presented {
        None => {
            let mut response = problem(
                StatusCode::UNAUTHORIZED,
                "this action needs the console token (Authorization: Bearer <token>)",
            );
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            Some(response)
        }
        Some(presented) if same_token(presented.trim().as_bytes(), token.as_bytes()) => None,
        Some(_) => Some(problem(StatusCode::FORBIDDEN, "wrong console token")),
    }
}

/// `POST /console/api/dead-letters/{retry|purge}` with a JSON [`Selection`]:
/// `dry_run` counts what would change; otherwise changes it through the same path
/// as `outbox dead-letters retry|purge`, audit line included.
async fn change(
    State(console): State<Console>,
    Path(action): Path<String>,
    ConnectInfo(client): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let change = match action.as_str() {
        "retry" => Change::Retry,
        "purge" => Change::Purge,
        other => return problem(StatusCode::NOT_FOUND, format!("no action `{other}`")),
    };
    if let Some(refused) = refusal(&console, &headers) {
        tracing::warn!(
            target: dead_letters::AUDIT,
            action = change.verb(),
            %client,
            "console: dead-letter change refused (token missing or wrong)"
        );
        return refused;
    }
    let selection: Selection = match serde_json::from_slice(&body) {
        Ok(selection) => selection,
        Err(error) => return problem(StatusCode::BAD_REQUEST, format!("request body: {error}")),
    };
    let (filter, members) = match selection
        .filter()
        .and_then(|f| Ok((f, selection.members(&console)?)))
    {
        Ok(chosen) => chosen,
        Err(message) => return problem(StatusCode::BAD_REQUEST, message),
    };
    if filter == DeadLetterFilter::default() && !selection.dry_run {
        // A selection of everything is allowed, but only said explicitly: an empty
        // body is more likely a mistake than a decision.
        if selection.outbox.is_none() {
            return problem(
                StatusCode::BAD_REQUEST,
                "select dead letters (ids or filters) or name the outbox to change all of its dead letters",
            );
        }
    }
    let by = format!("console {client}");
    let mut outboxes = Vec::new();
    for member in &members {
        let admin = admin_of(member);
        let result = if selection.dry_run {
            DeadLetterAdmin::count(&admin, &filter).await
        } else {
            dead_letters::apply(&admin, &member.name, change, &filter, &by).await
        };
        match result {
            Ok(n) => outboxes.push(json!({ "outbox": member.name, "count": n })),
            Err(error) => {
                return problem(
                    StatusCode::BAD_GATEWAY,
                    format!("outbox {}: {error}", member.name),
                )
            }
        }
    }
    let total: u64 = outboxes.iter().filter_map(|o| o["count"].as_u64()).sum();
    answer(
        StatusCode::OK,
        &json!({
            "action": change.verb(),
            "dry_run": selection.dry_run,
            "count": total,
            "outboxes": outboxes,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_when_equal() {
        assert!(same_token(b"s3cret", b"s3cret"));
        assert!(!same_token(b"s3creT", b"s3cret"));
        assert!(!same_token(b"s3cre", b"s3cret"));
        assert!(!same_token(b"", b"s3cret"));
    }

    #[test]
    fn passwords_in_error_text_are_hidden() {
        assert_eq!(
            redact("cannot reach amqp://app:hunter2@mq:5672/%2f: refused"),
            "cannot reach amqp://app:***@mq:5672/%2f: refused"
        );
        assert_eq!(redact("plain <script>"), "plain <script>");
    }
}
