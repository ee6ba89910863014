//! The JetStream [`Publisher`].

use std::future::IntoFuture;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::response::Response;
use async_nats::jetstream::{self, stream};
use async_nats::{ConnectOptions, HeaderMap, HeaderName, HeaderValue};
use futures_util::stream::{FuturesUnordered, StreamExt};
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::{redact_url, Event, Outcome, PublishError, Publisher, RunOrder, RunOutcome};
use tokio::sync::Semaphore;

use crate::config::NatsConfig;
use crate::error::{Error, Result};
use crate::headers;
use crate::routing::SubjectRouting;

/// How often a batch waiting for PubAcks looks whether the connection is lost.
const CONNECTION_WATCH: Duration = Duration::from_millis(50);

/// A PubAck awaited for at most the timeout.
type AckResult = std::result::Result<
    std::result::Result<jetstream::publish::PublishAck, jetstream::context::PublishError>,
    tokio::time::error::Elapsed,
>;

/// Default JetStream dedup window of streams made by [`NatsPublisher::stream_config`].
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// Publishes outbox events to NATS JetStream.
///
/// Each event becomes one message on the subject chosen by the [`SubjectRouting`],
/// with `Nats-Msg-Id` = event id (the server drops a repeat within the stream's
/// duplicate window and says so in the PubAck, which counts as published), the
/// metadata in headers (see [`crate::headers`]) and the JSON payload as body.
/// Messages of a batch are sent in order on one connection, many in flight, and
/// every PubAck is awaited.
///
/// Failures: a message over the server's max payload, an invalid subject or header,
/// or a stream refusing the message size are permanent; anything else (no
/// connection, timeout, no stream for the subject) is retryable.
///
/// An aggregate's run goes out pipelined ([`RunOrder::Pipelined`]) on a connection
/// of its own, one stretch of events with the same subject after the other, each
/// stretch's PubAcks awaited before the next. Why no message after a failed
/// message `k` is stored unless `k` was stored before it:
/// - The server handles a connection's messages in the order they arrive, and a
///   stream stores them in that order. A lost connection loses a tail of what was
///   sent; the run connection is never reconnected (its client would send what it
///   still holds on the new connection, after the lost message), and the next run
///   connects afresh. A PubAck that times out while the connection stays up is an
///   unknown outcome: what follows was stored after it, or not at all.
/// - A message that cannot be sent (over the server's max payload, an invalid
///   header) ends the run there.
/// - A message refused because no stream captures its subject is followed in its
///   stretch only by messages to the same subject, refused likewise.
///
/// Where it is not proven, and a later message of the stretch may be stored
/// ahead of `k`'s retry: stream limits that refuse `k` and take a later message
/// (`max_msg_size` with a later, smaller message; `discard = new` at `max_msgs`
/// or `max_bytes` while messages expire or a work-queue consumer removes some in
/// between), or a stream created for the subject in the middle of a stretch. The
/// relay logs such a run as an error. JetStream's optimistic headers do not help
/// there: `Nats-Expected-Last-Subject-Sequence` needs the stream sequence of the
/// previous message, known only from its PubAck.
///
/// A publisher made with [`NatsPublisher::from_client`] has no connection of its
/// own for runs and sends them one event per PubAck
/// ([`RunOrder::OneAtATime`]).
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    routing: SubjectRouting,
    envelope: Envelope,
    timeout: Duration,
    in_flight: Arc<Semaphore>,
    max_in_flight: usize,
    /// The server URL(s) without passwords, for messages.
    url: String,
    duplicates: AtomicU64,
    /// The connection of pipelined runs, for a publisher that made its own client
    /// (`None` for [`NatsPublisher::from_client`]: runs go one event at a time).
    runs: Option<RunLink>,
}

/// The connection that carries aggregates' runs pipelined. It is never
/// reconnected: after a disconnect its client would send the messages it still
/// holds on the new connection, and one lost with the old connection would be
/// overtaken. A lost one is left alone (its client waits for ever, holding what
/// it had not sent) and the next run connects afresh.
struct RunLink {
    config: NatsConfig,
    current: tokio::sync::Mutex<Option<Link>>,
}

impl std::fmt::Debug for RunLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunLink").finish_non_exhaustive()
    }
}

/// A client and its JetStream context.
#[derive(Clone)]
struct Link {
    client: async_nats::Client,
    jetstream: jetstream::Context,
}

impl NatsPublisher {
    pub(crate) async fn start(config: NatsConfig, eager: bool) -> Result<Self> {
        let servers = config.validate()?;
        let mut options = connect_options(&config).await?.max_reconnects(None);
        if !eager {
            options = options.retry_on_initial_connect();
        }
        let client = tokio::time::timeout(config.timeout, options.connect(servers))
            .await
            .map_err(|_| {
                connect_error(
                    &config,
                    format!("no connection within {:?}", config.timeout),
                )
            })?
            .map_err(|e| connect_error(&config, e.to_string()))?;
        let runs = RunLink {
            config: config.clone(),
            current: tokio::sync::Mutex::new(None),
        };
        Ok(Self::with_runs(client, config, Some(runs)))
    }

    /// A publisher on an existing client; `config` gives routing, timeout and in-flight
    /// limit (its connection settings are not used). Aggregates' runs then go one
    /// event per PubAck: there is no connection of its own to pipeline them on.
    pub fn from_client(client: async_nats::Client, config: NatsConfig) -> Self {
        Self::with_runs(client, config, None)
    }

    fn with_runs(client: async_nats::Client, config: NatsConfig, runs: Option<RunLink>) -> Self {
        let max_in_flight = config.max_in_flight.max(1);
        let jetstream = jetstream_of(client.clone(), config.timeout, max_in_flight);
        Self {
            inner: Arc::new(Inner {
                client,
                jetstream,
                routing: config.routing,
                envelope: config.envelope,
                timeout: config.timeout,
                runs,
                in_flight: Arc::new(Semaphore::new(max_in_flight)),
                max_in_flight,
                url: redact_url(&config.url),
                duplicates: AtomicU64::new(0),
            }),
        }
    }

    /// The NATS client (for subscribing, or sharing the connection).
    pub fn client(&self) -> &async_nats::Client {
        &self.inner.client
    }

    /// The JetStream context used to publish.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.inner.jetstream
    }

    /// The routing rule.
    pub fn routing(&self) -> &SubjectRouting {
        &self.inner.routing
    }

    /// Messages the server reported as duplicates (already stored within its
    /// duplicate window) since this publisher was built. They count as published.
    pub fn duplicates(&self) -> u64 {
        self.inner.duplicates.load(Ordering::Relaxed)
    }

    /// A file-backed stream `name` capturing `<prefix>.>` (the default routing rule's
    /// subjects) with a [`DEFAULT_DUPLICATE_WINDOW`] dedup window. Adjust it and pass
    /// it to [`NatsPublisher::ensure_stream`].
    pub fn stream_config(&self, name: &str) -> stream::Config {
        stream::Config {
            name: name.to_string(),
            subjects: vec![format!("{}.>", self.inner.routing.prefix())],
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            ..stream::Config::default()
        }
    }

    /// Create the stream if it does not exist yet (an existing one is left as is),
    /// and return its info.
    pub async fn ensure_stream(&self, config: stream::Config) -> Result<stream::Info> {
        let operation = format!("create stream {}", config.name);
        let mut stream = self
            .inner
            .jetstream
            .get_or_create_stream(config)
            .await
            .map_err(|e| Error::jetstream(&operation, e))?;
        let info = stream
            .info()
            .await
            .map_err(|e| Error::jetstream(&operation, e))?;
        Ok(info.clone())
    }

    /// Subject, headers and body of the message for `event`; an error text makes it
    /// permanent.
    fn message(&self, event: &Event) -> Result<(String, HeaderMap, Vec<u8>), String> {
        let subject = self.inner.routing.subject(event)?;
        let mut map = HeaderMap::new();
        let mut insert = |name: &str, value: &str| -> Result<(), String> {
            let header = HeaderName::from_str(name)
                .map_err(|e| format!("header name `{name}` is not valid in NATS: {e}"))?;
            let value = HeaderValue::from_str(value)
                .map_err(|e| format!("value of header `{name}` is not valid in NATS: {e}"))?;
            map.insert(header, value);
            Ok(())
        };
        let id = event.id.to_string();
        insert(headers::MSG_ID, &id)?;
        let encoded = self.inner.envelope.encode(event, &headers::BINDING);
        for (name, value) in encoded.all_headers() {
            if !headers::is_nats_reserved(name) {
                insert(name, value)?;
            }
        }
        insert(
            headers::CONTENT_TYPE,
            encoded.content_type.unwrap_or("application/json"),
        )?;
        Ok((subject, map, encoded.body.into_owned()))
    }

    /// The publisher's own client and context.
    fn link(&self) -> Link {
        Link {
            client: self.inner.client.clone(),
            jetstream: self.inner.jetstream.clone(),
        }
    }

    /// Send one message on `link`; the returned future resolves to its PubAck.
    async fn send(
        &self,
        link: &Link,
        event: &Event,
    ) -> Result<jetstream::context::PublishAckFuture, PublishError> {
        let (subject, headers, body) = self.message(event).map_err(PublishError::permanent)?;
        let publish = PublishMessage::build()
            .payload(body.into())
            .headers(headers);
        let timeout = self.inner.timeout;
        match tokio::time::timeout(
            timeout,
            link.jetstream.send_publish(subject.clone(), publish),
        )
        .await
        {
            Ok(Ok(ack)) => Ok(ack),
            Ok(Err(error)) => Err(classify(&subject, &error)),
            Err(_) => Err(PublishError::retryable(format!(
                "NATS publish to `{subject}`: not sent within {timeout:?} ({})",
                self.state(&link.client)
            ))),
        }
    }

    fn state(&self, client: &async_nats::Client) -> String {
        format!(
            "connection to {} {}",
            self.inner.url,
            client.connection_state()
        )
    }

    /// Send `events` on `link` and await their PubAcks. With `stop_at_failure`, a
    /// message that cannot be sent ends the sending: nothing after it goes out.
    async fn publish_chunk(
        &self,
        link: &Link,
        events: &[Event],
        outcomes: &mut [Option<Outcome>],
        stop_at_failure: bool,
    ) {
        // Take all permits of the chunk at once: concurrent batches cannot deadlock
        // on JetStream's in-flight limit, which has the same size.
        let permits = u32::try_from(events.len()).unwrap_or(u32::MAX);
        let _permits = match self.inner.in_flight.acquire_many(permits).await {
            Ok(permits) => permits,
            Err(_) => {
                for outcome in outcomes.iter_mut() {
                    *outcome = Some(Outcome::unavailable("NATS publisher closed"));
                }
                return;
            }
        };
        let mut acks = Vec::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            match self.send(link, event).await {
                Ok(ack) => acks.push((i, ack)),
                Err(error) => {
                    outcomes[i] = Some(Outcome::Failed(error));
                    if stop_at_failure {
                        break;
                    }
                }
            }
        }
        self.await_acks(&link.client, events, acks, outcomes).await;
    }

    /// Wait for the PubAcks of a chunk, each for at most the timeout, and stop
    /// waiting for the rest as soon as the connection is seen lost: acks the
    /// server sent on the lost connection never arrive, and a message still in
    /// the client's buffer waits for a reconnect of unknown length. So a network
    /// cut fails the chunk within [`CONNECTION_WATCH`] instead of after the
    /// timeout, and the relay starts probing for the broker at once. A message
    /// the server stored before the cut is published again later and dropped by
    /// the stream's duplicate window (`Nats-Msg-Id`).
    async fn await_acks(
        &self,
        client: &async_nats::Client,
        events: &[Event],
        acks: Vec<(usize, jetstream::context::PublishAckFuture)>,
        outcomes: &mut [Option<Outcome>],
    ) {
        let timeout = self.inner.timeout;
        let mut pending: FuturesUnordered<_> =
            acks.into_iter()
                .map(|(i, ack)| async move {
                    (i, tokio::time::timeout(timeout, ack.into_future()).await)
                })
                .collect();
        let mut watch = tokio::time::interval(CONNECTION_WATCH);
        watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                next = pending.next() => match next {
                    Some((i, result)) => outcomes[i] = Some(self.ack_outcome(&events[i], result, timeout)),
                    None => return,
                },
                _ = watch.tick() => {
                    if client.connection_state() == State::Disconnected {
                        break;
                    }
                }
            }
        }
        let lost = format!(
            "NATS: connection lost before the PubAck ({})",
            self.state(client)
        );
        let unacknowledged = pending.len();
        tracing::debug!(unacknowledged, "{lost}");
        for outcome in outcomes.iter_mut().filter(|o| o.is_none()) {
            *outcome = Some(Outcome::retryable(lost.clone()));
        }
    }

    fn ack_outcome(&self, event: &Event, result: AckResult, timeout: Duration) -> Outcome {
        match result {
            Ok(Ok(ack)) => {
                if ack.duplicate {
                    self.inner.duplicates.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(event_id = %event.id, stream = %ack.stream, "duplicate PubAck: already stored");
                }
                Outcome::Published
            }
            Ok(Err(error)) => {
                let subject = self.inner.routing.subject(event).unwrap_or_default();
                Outcome::Failed(classify(&subject, &error))
            }
            Err(_) => Outcome::retryable(format!(
                "NATS: no PubAck for event {} within {timeout:?}",
                event.id,
            )),
        }
    }
}

impl NatsPublisher {
    /// Publish `events` on `link` in chunks of the in-flight limit; with
    /// `stop_at_failure`, stop at the first failure (the outcomes end there).
    async fn deliver(&self, link: &Link, events: &[Event], stop_at_failure: bool) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        let chunk = self.inner.max_in_flight;
        for (events, outcomes) in events.chunks(chunk).zip(outcomes.chunks_mut(chunk)) {
            self.publish_chunk(link, events, outcomes, stop_at_failure)
                .await;
            let failed = outcomes
                .iter()
                .any(|o| !matches!(o, Some(Outcome::Published)));
            if failed && stop_at_failure {
                break;
            }
        }
        // Failures that may pass, while the client has no connection, are the
        // outage's, not the messages': the relay counts no attempt for them.
        let connected = link.client.connection_state() == State::Connected;
        outcomes
            .into_iter()
            .map(|o| match o {
                Some(Outcome::Failed(error)) if !connected && error.is_retryable() => {
                    Outcome::unavailable(format!(
                        "{} ({})",
                        error.message,
                        self.state(&link.client)
                    ))
                }
                Some(outcome) => outcome,
                None => Outcome::retryable("NATS: message was not sent"),
            })
            .collect()
    }
}

impl Publisher for NatsPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        self.deliver(&self.link(), events, false).await
    }

    fn run_order(&self) -> RunOrder {
        match self.inner.runs {
            Some(_) => RunOrder::Pipelined,
            None => RunOrder::OneAtATime,
        }
    }

    /// On the run connection (see the type's documentation), one stretch of events
    /// with the same subject after the other, each pipelined.
    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        let Some(runs) = &self.inner.runs else {
            // No connection of its own for runs: one event per PubAck.
            let link = self.link();
            for (k, event) in run.iter().enumerate() {
                let outcome = self.deliver(&link, std::slice::from_ref(event), true).await;
                if let Some(Outcome::Failed(error)) = outcome.into_iter().next() {
                    return RunOutcome::failed(k, error);
                }
            }
            return RunOutcome::complete(run.len());
        };
        let link = match runs.get(self.inner.max_in_flight).await {
            Ok(link) => link,
            Err(error) => return RunOutcome::failed(0, error),
        };
        let routing = &self.inner.routing;
        let mut published = 0;
        for stretch in run.chunk_by(
            |a, b| matches!((routing.subject(a), routing.subject(b)), (Ok(a), Ok(b)) if a == b),
        ) {
            let outcome = RunOutcome::from_outcomes(self.deliver(&link, stretch, true).await);
            published += outcome.published;
            if let Some(error) = outcome.failure {
                return RunOutcome::failed(published, error);
            }
        }
        RunOutcome::complete(run.len())
    }

    async fn check(&self) -> Result<(), PublishError> {
        // A publisher built a moment ago may still be making its first connection
        // (it connects lazily): give that one the timeout, as a send would.
        let deadline = tokio::time::Instant::now() + self.inner.timeout;
        while self.inner.client.connection_state() == State::Pending
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if self.inner.client.connection_state() != State::Connected {
            return Err(PublishError::unavailable(format!(
                "NATS: {}",
                self.state(&self.inner.client)
            )));
        }
        // The account INFO request proves JetStream answers; its body is not parsed
        // (its layout varies between server versions).
        let info = self
            .inner
            .jetstream
            .request::<_, _, Response<serde_json::Value>>("INFO", b"");
        match tokio::time::timeout(self.inner.timeout, info).await {
            Ok(Ok(Response::Ok(_))) => Ok(()),
            Ok(Ok(Response::Err { error })) => Err(PublishError::unavailable(format!(
                "NATS JetStream unavailable: {error}"
            ))),
            Ok(Err(e)) => Err(PublishError::unavailable(format!(
                "NATS JetStream unavailable: {e}"
            ))),
            Err(_) => Err(PublishError::unavailable(format!(
                "NATS JetStream: no answer within {:?}",
                self.inner.timeout
            ))),
        }
    }
}

/// The connection options of `config` (name, timeouts, credentials, TLS).
async fn connect_options(config: &NatsConfig) -> Result<ConnectOptions> {
    crate::tls::ensure_crypto_provider();
    let mut options = ConnectOptions::new()
        .name(&config.client_name)
        .connection_timeout(config.timeout)
        .request_timeout(Some(config.timeout));
    if let Some((user, password)) = &config.user_password {
        options = options.user_and_password(user.clone(), password.clone());
    }
    if let Some(token) = &config.token {
        options = options.token(token.clone());
    }
    if let Some(path) = &config.credentials_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| Error::config("credentials_file", format!("`{}`: {e}", path.display())))?;
    }
    if let Some(path) = &config.nkey_seed_file {
        options = options.nkey(crate::config::read_nkey_seed(path)?);
    }
    if config.tls_required {
        options = options.require_tls(true);
    }
    if let Some(ca) = &config.tls_ca_file {
        options = options.add_root_certificates(ca.clone());
    }
    if let Some((cert, key)) = &config.tls_client_cert {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(options)
}

fn connect_error(config: &NatsConfig, reason: String) -> Error {
    Error::Connect {
        url: redact_url(&config.url),
        reason,
    }
}

/// The JetStream context the publisher sends with on `client`.
fn jetstream_of(
    client: async_nats::Client,
    timeout: Duration,
    max_in_flight: usize,
) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(timeout)
        .max_ack_inflight(max_in_flight)
        .backpressure_on_inflight(true)
        .build(client)
}

impl RunLink {
    /// The run connection, connecting a new one when there is none or it was lost.
    async fn get(&self, max_in_flight: usize) -> std::result::Result<Link, PublishError> {
        let mut current = self.current.lock().await;
        if let Some(link) = current.as_ref() {
            if link.client.connection_state() == State::Connected {
                return Ok(link.clone());
            }
        }
        *current = None;
        let unavailable = |reason: String| {
            PublishError::unavailable(format!(
                "NATS: no connection for runs to {}: {reason}",
                redact_url(&self.config.url)
            ))
        };
        let servers = self
            .config
            .validate()
            .map_err(|e| unavailable(e.to_string()))?;
        let options = connect_options(&self.config)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        // Connect at once; once connected, a reconnect waits for ever: never resend.
        let connected = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let once = Arc::clone(&connected);
        let options = options.reconnect_delay_callback(move |_| {
            if once.load(Ordering::SeqCst) {
                Duration::MAX
            } else {
                Duration::ZERO
            }
        });
        let client = tokio::time::timeout(self.config.timeout, options.connect(servers))
            .await
            .map_err(|_| unavailable(format!("no connection within {:?}", self.config.timeout)))?
            .map_err(|e| unavailable(e.to_string()))?;
        connected.store(true, Ordering::SeqCst);
        let link = Link {
            jetstream: jetstream_of(client.clone(), self.config.timeout, max_in_flight),
            client,
        };
        *current = Some(link.clone());
        Ok(link)
    }
}

/// Permanent when the same message will be refused again; unavailable when the
/// connection broke; retryable otherwise.
fn classify(subject: &str, error: &jetstream::context::PublishError) -> PublishError {
    let text = format!("NATS publish to `{subject}`: {error}");
    match error.kind() {
        PublishErrorKind::MaxPayloadExceeded
        | PublishErrorKind::WrongLastMessageId
        | PublishErrorKind::WrongLastSequence => PublishError::permanent(text),
        PublishErrorKind::BrokenPipe => PublishError::unavailable(text),
        PublishErrorKind::StreamNotFound => PublishError::retryable(format!(
            "{text} (no JetStream stream captures this subject; create one, e.g. with NatsPublisher::ensure_stream)"
        )),
        PublishErrorKind::Other => {
            let code = std::error::Error::source(error)
                .and_then(|s| s.downcast_ref::<jetstream::Error>())
                .map(jetstream::Error::error_code);
            match code {
                Some(jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => PublishError::permanent(text),
                _ => PublishError::retryable(text),
            }
        }
        _ => PublishError::retryable(text),
    }
}
