//! The RabbitMQ [`Publisher`]: publisher confirms, `mandatory`, reconnect on loss.

use std::borrow::Cow;
use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex as StdMutex, PoisonError};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use pgoutbox_core::{redact_url, Event, Outcome, PublishError, Publisher, RunOrder, RunOutcome};
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};

use crate::config::AmqpConfig;
use crate::error::{Error, Result};
use crate::headers;
use crate::routing::{AmqpRouting, MAX_SHORT_STRING};

/// Publishes outbox events to RabbitMQ (AMQP 0.9.1).
///
/// Each event is one persistent message (`delivery_mode` 2) with `message_id` = event
/// id, `type` = event type, `content_type` `application/json`, `timestamp` = created_at
/// (seconds) and the metadata and user headers in the header table (see [`crate::headers`]).
/// Publisher confirms are on and every confirm is awaited; messages are `mandatory`,
/// so a message no queue is bound for comes back (`basic.return`) and fails
/// permanently, alone. A `nack` fails its message only (retryable). No connection
/// (refused, lost mid-batch, authentication failed) fails the batch as
/// [`pgoutbox_core::FailureKind::Unavailable`]: an outage counts no attempt.
///
/// The connection is opened on first use; a lost connection or channel is dropped and
/// re-opened by the next batch. Each send-and-confirm (a batch's single events, one
/// stretch of a run) holds a confirm channel of its own on that connection, up to
/// 256 at once, kept open for later batches: returns are matched to their messages
/// only among one channel's confirms.
///
/// An aggregate's run is sent pipelined ([`RunOrder::Pipelined`]): each stretch of
/// it going to one exchange with one routing key is sent whole on one channel,
/// its confirms awaited, then the next stretch (confirmed messages are routed
/// already, so the next stretch's channel does not matter). Why no message after a failed
/// message `k` is stored unless `k` was stored before it:
/// - RabbitMQ routes the messages of a channel in the order they arrive, and the
///   channel's frames arrive in the order sent (one TCP connection). A lost
///   connection loses a tail of them: what was stored is a head of the run, and the
///   first unconfirmed message starts the retry (a stored but unconfirmed one comes
///   twice, in order). The run is never continued on another connection.
/// - A channel error (e.g. the exchange is gone) closes the channel: the server
///   drops every later message of it.
/// - An unroutable message (`basic.return`, `mandatory`) fails permanently. The
///   messages after it in its stretch have the same exchange and routing key, so
///   the same bindings refuse them too; the next stretch is not sent.
///
/// Where it is not proven, and pipelining a run may let later messages reach
/// consumers ahead of `k`'s retry (or of its replay from the dead letters): a
/// `nack` of `k` with later messages confirmed (RabbitMQ nacks only when a queue
/// cannot take a message: an internal error of the queue process, or a queue at
/// its length limit with `overflow = reject-publish` that a consumer drains in
/// between), and a headers exchange that routes by headers that differ between the
/// events of a run. The relay logs such a run as an error. Where that matters, use
/// `overflow = drop-head` or no length limit, route by routing key, or wrap the
/// publisher in one that keeps [`RunOrder::OneAtATime`].
#[derive(Debug, Clone)]
pub struct AmqpPublisher {
    inner: Arc<Inner>,
}

/// One event as an AMQP message.
struct Outgoing<'e> {
    exchange: String,
    routing_key: String,
    properties: BasicProperties,
    body: Cow<'e, [u8]>,
}

/// Confirm channels a publisher holds open at most (fewer when the broker's
/// `channel_max` is lower): each send-and-confirm holds one alone
/// ([`ConfirmChannel`]); more runs at once wait for one to come back. A batch of
/// 200 events over 100 aggregates is about 100 runs at once: with 32 channels
/// they drained about 20% slower than with 256 (BENCHMARKS.md).
const MAX_CONFIRM_CHANNELS: usize = 256;

#[derive(Debug)]
struct Inner {
    config: AmqpConfig,
    state: Mutex<Option<Link>>,
}

#[derive(Debug)]
struct Link {
    connection: Connection,
    /// Topology and health checks ([`AmqpPublisher::channel`]).
    channel: Channel,
    /// Confirm channels open, settled and not in use.
    idle: Arc<StdMutex<Vec<Channel>>>,
    /// One permit per confirm channel in use: at most [`MAX_CONFIRM_CHANNELS`], and
    /// fewer than the connection's `channel_max`.
    permits: Arc<Semaphore>,
}

/// A confirm channel held by one send-and-confirm alone.
///
/// lapin hands a `basic.return` to whichever pending confirm of the channel the
/// next ack resolves first (with a `multiple` ack, any one it covers), which may
/// be the confirm of a message another run sent at the same time. Returns are
/// matched to their messages by message id within one send-and-confirm, so every
/// pending confirm of its channel must be its own: a channel shared by concurrent
/// runs lost returns, and an unroutable message was reported published.
///
/// Back to the idle channels only when [`ConfirmChannel::settle`]d: every confirm
/// resolved. Dropped otherwise (a confirm timed out, the call was cancelled), it is
/// closed, so that no late ack or return of it reaches a later batch.
struct ConfirmChannel {
    channel: Channel,
    idle: Arc<StdMutex<Vec<Channel>>>,
    settled: bool,
    _permit: OwnedSemaphorePermit,
}

impl ConfirmChannel {
    /// Every confirm sent on it resolved: the channel may serve another batch.
    fn settle(mut self) {
        self.settled = true;
    }
}

impl Drop for ConfirmChannel {
    fn drop(&mut self) {
        if !self.channel.status().connected() {
            return;
        }
        if self.settled {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            idle.push(self.channel.clone());
        } else if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let channel = self.channel.clone();
            runtime.spawn(async move {
                // Best effort: the connection may be going too.
                let _ = channel.close(200, "outbox: unsettled confirms").await;
            });
        }
    }
}

/// A new channel on `connection` with publisher confirms on.
async fn open_confirm_channel(connection: &Connection) -> std::result::Result<Channel, String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| format!("open channel: {e}"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| format!("enable publisher confirms: {e}"))?;
    Ok(channel)
}

impl AmqpPublisher {
    pub(crate) fn new(config: AmqpConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                config,
                state: Mutex::new(None),
            }),
        }
    }

    /// The routing rule.
    pub fn routing(&self) -> &AmqpRouting {
        &self.inner.config.routing
    }

    /// Open the connection now if it is not open.
    pub async fn connect(&self) -> Result<()> {
        self.channel().await.map(|_| ())
    }

    /// A channel with publisher confirms on, for topology and checks (batches publish
    /// on channels of their own), opening the connection if needed.
    pub async fn channel(&self) -> Result<Channel> {
        let mut state = self.inner.state.lock().await;
        Ok(self.link(&mut state).await?.channel.clone())
    }

    /// The open link, connecting if there is none or it was lost.
    async fn link<'s>(&self, state: &'s mut Option<Link>) -> Result<&'s Link> {
        let config = &self.inner.config;
        if let Some(link) = state.as_ref() {
            if link.connection.status().connected() && link.channel.status().connected() {
                // Borrowed again: returning `link` itself would keep `state` borrowed
                // on the path below that replaces it (the borrow checker cannot yet
                // end a borrow returned on one branch only).
                return Ok(state.as_ref().expect("checked above"));
            }
            tracing::warn!(url = %redact_url(&config.url), "AMQP connection or channel lost; reconnecting");
        }
        *state = None;
        let connect_error = |reason: String| Error::Connect {
            url: redact_url(&config.url),
            reason,
        };
        let open = async {
            let properties = ConnectionProperties::default()
                .with_connection_name(config.connection_name.clone().into());
            crate::tls::ensure_crypto_provider();
            let mut uri = AMQPUri::from_str(&config.url).map_err(connect_error)?;
            if let Some(password) = &config.password {
                uri.authority.userinfo.password.clone_from(password);
            }
            let tls = OwnedTLSConfig {
                identity: None,
                // Read at each connect: a renewed CA file is picked up on reconnect.
                cert_chain: match &config.tls_ca_file {
                    Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                        connect_error(format!("CA file `{}`: {e}", path.display()))
                    })?),
                    None => None,
                },
            };
            let connection = Connection::connect_uri_with_config(uri, properties, tls)
                .await
                .map_err(|e| connect_error(e.to_string()))?;
            let channel = open_confirm_channel(&connection)
                .await
                .map_err(connect_error)?;
            // The topology channel is one of the connection's `channel_max`.
            let channel_max = usize::from(connection.configuration().channel_max());
            let permits = MAX_CONFIRM_CHANNELS.min(channel_max.saturating_sub(1).max(1));
            Ok::<_, Error>(Link {
                connection,
                channel,
                idle: Arc::default(),
                permits: Arc::new(Semaphore::new(permits)),
            })
        };
        let link = tokio::time::timeout(config.timeout, open)
            .await
            .map_err(|_| connect_error(format!("no connection within {:?}", config.timeout)))??;
        Ok(state.insert(link))
    }

    /// A confirm channel for one send-and-confirm: an idle one, or a new one while
    /// fewer than the link's permits are in use.
    async fn confirm_channel(&self) -> Result<ConfirmChannel> {
        let (permits, idle) = {
            let mut state = self.inner.state.lock().await;
            let link = self.link(&mut state).await?;
            (Arc::clone(&link.permits), Arc::clone(&link.idle))
        };
        let permit = permits
            .acquire_owned()
            .await
            .expect("the permits are never closed");
        let reused = {
            let mut channels = idle.lock().unwrap_or_else(PoisonError::into_inner);
            std::iter::from_fn(|| channels.pop()).find(|c| c.status().connected())
        };
        let (channel, idle) = match reused {
            Some(channel) => (channel, idle),
            None => {
                // Opening a channel takes the link again: the one the permit came
                // from, or a new one if it was lost meanwhile (the permit then counts
                // against the old link's channels: a reconnect may briefly open more).
                let config = &self.inner.config;
                let mut state = self.inner.state.lock().await;
                let link = self.link(&mut state).await?;
                let channel =
                    tokio::time::timeout(config.timeout, open_confirm_channel(&link.connection))
                        .await
                        .unwrap_or_else(|_| Err(format!("no channel within {:?}", config.timeout)))
                        .map_err(|reason| Error::Connect {
                            url: redact_url(&config.url),
                            reason,
                        })?;
                (channel, Arc::clone(&link.idle))
            }
        };
        Ok(ConfirmChannel {
            channel,
            idle,
            settled: false,
            _permit: permit,
        })
    }

    /// Forget the link if its connection is gone, so the next batch reconnects.
    async fn forget_lost_link(&self) {
        let mut state = self.inner.state.lock().await;
        if state
            .as_ref()
            .is_some_and(|l| !l.connection.status().connected())
        {
            if let Some(link) = state.take() {
                // Best effort: the connection may already be gone.
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    link.connection.close(0, "outbox: reconnecting"),
                )
                .await;
            }
        }
    }

    /// Declare the routing rule's exchange (durable) with this kind; an existing exchange
    /// with the same settings is left as is.
    pub async fn declare_exchange(&self, kind: ExchangeKind) -> Result<()> {
        let exchange = self.routing().exchange().to_string();
        let channel = self.channel().await?;
        channel
            .exchange_declare(
                &exchange,
                kind,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|source| Error::Topology {
                operation: format!("declare exchange {exchange}"),
                source,
            })
    }

    /// The message for `event`; an error text is permanent.
    fn message<'e>(&self, event: &'e Event) -> Result<Outgoing<'e>, String> {
        let route = self.routing().route(event)?;
        let mut table = FieldTable::default();
        let mut insert = |name: &str, value: &str| -> Result<(), String> {
            if name.len() > MAX_SHORT_STRING {
                return Err(format!("header name `{name}` is over 255 bytes"));
            }
            table.insert(
                ShortString::from(name),
                AMQPValue::LongString(LongString::from(value)),
            );
            Ok(())
        };
        let encoded = self.inner.config.envelope.encode(event, &headers::BINDING);
        for (name, value) in encoded.all_headers() {
            insert(name, value)?;
        }
        let id = event.id.to_string();
        let content_type = encoded.content_type.unwrap_or("application/json");
        let mut properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_content_type(content_type.into())
            .with_delivery_mode(2)
            .with_timestamp(u64::try_from(event.created_at.timestamp()).unwrap_or(0))
            .with_headers(table);
        if event.event_type.len() <= MAX_SHORT_STRING {
            properties = properties.with_type(event.event_type.as_str().into());
        }
        Ok(Outgoing {
            exchange: route.exchange,
            routing_key: route.routing_key,
            properties,
            body: encoded.body,
        })
    }

    async fn send(
        &self,
        channel: &Channel,
        event: &Event,
    ) -> Result<PublisherConfirm, PublishError> {
        let Outgoing {
            exchange,
            routing_key,
            properties,
            body,
        } = self.message(event).map_err(PublishError::permanent)?;
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let timeout = self.inner.config.timeout;
        let publish = channel.basic_publish(&exchange, &routing_key, options, &body, properties);
        match tokio::time::timeout(timeout, publish).await {
            Ok(Ok(confirm)) => Ok(confirm),
            Ok(Err(e)) => Err(PublishError::retryable(format!(
                "AMQP publish to exchange `{exchange}` key `{routing_key}`: {e}"
            ))),
            Err(_) => Err(PublishError::retryable(format!(
                "AMQP publish to exchange `{exchange}`: not sent within {timeout:?}"
            ))),
        }
    }
}

impl Publisher for AmqpPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        self.deliver(events, false).await
    }

    fn run_order(&self) -> RunOrder {
        RunOrder::Pipelined
    }

    /// The run in flight on confirm channels, one stretch of events with the
    /// same exchange and routing key after the other; see the type's documentation
    /// for why the order holds and where it may not.
    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        let routing = self.routing();
        let mut published = 0;
        for stretch in run.chunk_by(
            |a, b| matches!((routing.route(a), routing.route(b)), (Ok(a), Ok(b)) if a == b),
        ) {
            let outcome = RunOutcome::from_outcomes(self.deliver(stretch, true).await);
            published += outcome.published;
            if let Some(error) = outcome.failure {
                return RunOutcome::failed(published, error);
            }
        }
        RunOutcome::complete(run.len())
    }

    async fn check(&self) -> Result<(), PublishError> {
        self.channel()
            .await
            .map(|_| ())
            .map_err(|e| PublishError::unavailable(e.to_string()))
    }
}

impl AmqpPublisher {
    /// Send `events` in order on the confirm channel and await every confirm. With
    /// `stop_at_failure`, a message that cannot be sent ends the sending: nothing
    /// after it goes out (reported as not sent).
    async fn deliver(&self, events: &[Event], stop_at_failure: bool) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let lease = match self.confirm_channel().await {
            Ok(lease) => lease,
            // No connection (refused, lost, authentication failed): the broker's failure.
            Err(error) => return vec![Outcome::unavailable(error.to_string()); events.len()],
        };
        let channel = &lease.channel;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        let mut confirms = Vec::with_capacity(events.len());
        let mut broken = false;
        for (i, event) in events.iter().enumerate() {
            match self.send(channel, event).await {
                Ok(confirm) => confirms.push((i, confirm)),
                Err(error) => {
                    broken |= error.is_retryable();
                    outcomes[i] = Some(Outcome::Failed(error));
                    if stop_at_failure {
                        break;
                    }
                }
            }
        }
        let timeout = self.inner.config.timeout;
        let results =
            futures_util::future::join_all(confirms.into_iter().map(|(i, confirm)| async move {
                (i, tokio::time::timeout(timeout, confirm).await)
            }))
            .await;
        // lapin hands a `basic.return` to whichever confirm resolves next, not
        // necessarily the returned message's own (all of them this call's: see
        // `ConfirmChannel`): match returns by message id.
        let mut returned_ids: HashMap<String, String> = HashMap::new();
        for (_, result) in &results {
            if let Ok(Ok(Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r)))) = result {
                if let Some(id) = r.properties.message_id() {
                    returned_ids.insert(
                        id.to_string(),
                        format!(
                            "AMQP: unroutable: exchange `{}` routing key `{}` returned by the broker: {} {}",
                            r.delivery.exchange, r.delivery.routing_key, r.reply_code, r.reply_text
                        ),
                    );
                }
            }
        }
        for (i, result) in results {
            let event = &events[i];
            let outcome = match (returned_ids.remove(&event.id.to_string()), result) {
                (Some(reason), _) => Outcome::permanent(reason),
                (None, Ok(Ok(Confirmation::Ack(_)))) => Outcome::Published,
                (None, Ok(Ok(Confirmation::Nack(_)))) => {
                    Outcome::retryable("AMQP: the broker nacked the message")
                }
                (None, Ok(Ok(Confirmation::NotRequested))) => {
                    Outcome::retryable("AMQP: publisher confirms are not enabled on the channel")
                }
                (None, Ok(Err(e))) => {
                    broken = true;
                    Outcome::retryable(format!("AMQP: no publisher confirm: {e}"))
                }
                (None, Err(_)) => {
                    broken = true;
                    Outcome::retryable(format!("AMQP: no publisher confirm within {timeout:?}"))
                }
            };
            outcomes[i] = Some(outcome);
        }
        // Failures that may pass, on a channel that lost its connection, are the
        // outage's, not the messages': the relay counts no attempt for them.
        let lost = broken && !channel.status().connected();
        if lost {
            self.forget_lost_link().await;
        } else if !broken {
            lease.settle();
        }
        outcomes
            .into_iter()
            .map(|o| match o {
                Some(Outcome::Failed(error)) if lost && error.is_retryable() => {
                    Outcome::unavailable(format!("{} (AMQP connection lost)", error.message))
                }
                Some(outcome) => outcome,
                None => Outcome::retryable("AMQP: message was not sent"),
            })
            .collect()
    }
}
