//! [`SqsPublisher`]: events to SQS with `SendMessageBatch`.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use futures_util::stream::{self, StreamExt};
use pgoutbox_core::{Event, Outcome, PublishError, Publisher};

use crate::config::SqsConfig;
use crate::envelope::{self, attribute_value};
use crate::routing::{is_fifo, Queues, Target};
use pgoutbox_core::envelope::Envelope;

/// Most entries in one `SendMessageBatch`.
const MAX_BATCH_ENTRIES: usize = 10;

/// Publishes events to Amazon SQS: queue by routing rule, body = the JSON payload,
/// outbox metadata in message attributes (see [`crate::headers::EVENT_ID`] and the
/// crate docs). On FIFO queues (URL ending in `.fifo`) `MessageGroupId` is the
/// aggregate id and `MessageDeduplicationId` the event id.
///
/// Events go out with `SendMessageBatch`, at most 10 entries and
/// [`SqsConfig::max_message_bytes`] per call; each entry's result becomes its
/// event's outcome, so a refused entry fails alone.
///
/// Failure mapping: message over the size limit (checked before sending), invalid
/// or missing queue, entry refused as the sender's fault: permanent. Throttling,
/// server errors, timeouts, network errors: retryable.
///
/// An aggregate's run goes out one event per call
/// ([`pgoutbox_core::RunOrder::OneAtATime`], the default), while the relay batches
/// the events of different aggregates. Ten events of one message group in one
/// `SendMessageBatch` would be stored in order, but SQS reports a result per entry
/// and does not promise that the entries after a failed one (throttled, an internal
/// error: retryable) are refused too; a consumer could then receive them ahead of
/// the failed one's retry. SQS has no conditional send to make it refuse them.
#[derive(Debug)]
pub struct SqsPublisher {
    client: aws_sdk_sqs::Client,
    routing: Queues,
    max_message_bytes: usize,
    concurrency: usize,
    envelope: Envelope,
    urls: Mutex<HashMap<String, String>>,
}

/// One event ready to send.
struct Entry {
    index: usize,
    aggregate_id: String,
    size: usize,
    request: SendMessageBatchRequestEntry,
}

impl SqsPublisher {
    /// A publisher on an existing client (its own endpoint, credentials, region,
    /// timeouts); only the routing and limits of `config` are used.
    pub fn from_client(client: aws_sdk_sqs::Client, config: SqsConfig) -> Self {
        Self {
            client,
            routing: config.routing.compile(),
            max_message_bytes: config.max_message_bytes,
            concurrency: config.concurrency,
            envelope: config.envelope,
            urls: Mutex::new(HashMap::new()),
        }
    }

    /// The SQS client.
    pub fn client(&self) -> &aws_sdk_sqs::Client {
        &self.client
    }

    /// The URL of the queue `event` is routed to (queue names resolved and cached).
    pub async fn queue_url_for(&self, event: &Event) -> Result<String, PublishError> {
        let target = self.routing.target(event)?;
        self.resolve(&target).await
    }

    async fn resolve(&self, target: &Target) -> Result<String, PublishError> {
        let name = match target {
            Target::Url(url) => return Ok(url.clone()),
            Target::Name(name) => name,
        };
        if let Some(url) = self.cached(name) {
            return Ok(url);
        }
        match self.client.get_queue_url().queue_name(name).send().await {
            Ok(out) => {
                let url = out.queue_url().ok_or_else(|| {
                    PublishError::retryable(format!("sqs: GetQueueUrl of {name} returned no URL"))
                })?;
                if let Ok(mut urls) = self.urls.lock() {
                    urls.insert(name.clone(), url.to_string());
                }
                Ok(url.to_string())
            }
            Err(error) => Err(classify(&error, &format!("GetQueueUrl {name}"))),
        }
    }

    fn cached(&self, name: &str) -> Option<String> {
        self.urls
            .lock()
            .ok()
            .and_then(|urls| urls.get(name).cloned())
    }

    fn entry(&self, index: usize, event: &Event, fifo: bool) -> Result<Entry, PublishError> {
        let encoded = self.envelope.encode(event, &crate::headers::BINDING);
        // Every envelope's body is JSON text.
        let body = std::str::from_utf8(&encoded.body)
            .map_err(|e| PublishError::permanent(format!("sqs: body is not UTF-8: {e}")))?;
        let attributes = envelope::attributes(&encoded);
        let size = envelope::message_size(body, &attributes);
        if size > self.max_message_bytes {
            return Err(PublishError::permanent(format!(
                "sqs: message of {size} bytes (body and attributes) exceeds the limit of {} bytes",
                self.max_message_bytes
            )));
        }
        let mut builder = SendMessageBatchRequestEntry::builder()
            .id(index.to_string())
            .message_body(body);
        for (name, value) in attributes {
            let value = attribute_value(value).ok_or_else(|| {
                PublishError::permanent(format!("sqs: cannot build attribute {name}"))
            })?;
            builder = builder.message_attributes(name, value);
        }
        if fifo {
            builder = builder
                .message_group_id(&event.aggregate_id)
                .message_deduplication_id(event.id.to_string());
        }
        let request = builder
            .build()
            .map_err(|e| PublishError::permanent(format!("sqs: invalid entry: {e}")))?;
        Ok(Entry {
            index,
            aggregate_id: event.aggregate_id.clone(),
            size,
            request,
        })
    }

    /// Send the entries of one queue; returns (index, outcome) pairs. Calls run
    /// concurrently, except on a FIFO queue when a group has several entries: then
    /// one call at a time, so that they reach the queue in order. (The relay hands
    /// a publisher at most one event per aggregate per call.)
    async fn send_queue(&self, url: &str, entries: Vec<Entry>) -> Vec<(usize, Outcome)> {
        let mut groups = HashSet::new();
        let ordered = is_fifo(url)
            && !entries
                .iter()
                .all(|e| groups.insert(e.aggregate_id.as_str()));
        let chunks = chunk(entries, self.max_message_bytes);
        if !ordered {
            return stream::iter(chunks)
                .map(|c| self.send_chunk(url, c))
                .buffer_unordered(self.concurrency)
                .flat_map(stream::iter)
                .collect()
                .await;
        }
        let mut out = Vec::new();
        for chunk in chunks {
            out.extend(self.send_chunk(url, chunk).await);
        }
        out
    }

    async fn send_chunk(&self, url: &str, entries: Vec<Entry>) -> Vec<(usize, Outcome)> {
        if entries.is_empty() {
            return Vec::new();
        }
        let indexes: Vec<usize> = entries.iter().map(|e| e.index).collect();
        let requests: Vec<SendMessageBatchRequestEntry> =
            entries.into_iter().map(|e| e.request).collect();
        let result = self
            .client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(requests))
            .send()
            .await;
        let out = match result {
            Ok(out) => out,
            Err(error) => {
                let failure = classify(&error, &format!("SendMessageBatch {url}"));
                return indexes
                    .into_iter()
                    .map(|i| (i, Outcome::Failed(failure.clone())))
                    .collect();
            }
        };
        let ok: HashSet<&str> = out.successful().iter().map(|s| s.id()).collect();
        let failed: HashMap<&str, _> = out.failed().iter().map(|f| (f.id(), f)).collect();
        indexes
            .into_iter()
            .map(|index| {
                let id = index.to_string();
                let outcome = if ok.contains(id.as_str()) {
                    Outcome::Published
                } else if let Some(f) = failed.get(id.as_str()) {
                    let message = format!(
                        "sqs: {} refused by {url}: {}",
                        f.code(),
                        f.message().unwrap_or("no message")
                    );
                    if f.sender_fault() && !is_throttling(f.code()) {
                        Outcome::permanent(message)
                    } else {
                        Outcome::retryable(message)
                    }
                } else {
                    Outcome::retryable(format!("sqs: no result for entry {id} from {url}"))
                };
                (index, outcome)
            })
            .collect()
    }
}

impl Publisher for SqsPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        // Resolve each distinct target once, then group the entries per queue URL.
        let mut urls: HashMap<Target, Result<String, PublishError>> = HashMap::new();
        let mut queues: Vec<(String, Vec<Entry>)> = Vec::new();
        for (index, event) in events.iter().enumerate() {
            let target = match self.routing.target(event) {
                Ok(t) => t,
                Err(e) => {
                    outcomes[index] = Some(Outcome::Failed(e));
                    continue;
                }
            };
            if !urls.contains_key(&target) {
                let url = self.resolve(&target).await;
                urls.insert(target.clone(), url);
            }
            let url = match urls.get(&target) {
                Some(Ok(url)) => url.clone(),
                Some(Err(e)) => {
                    outcomes[index] = Some(Outcome::Failed(e.clone()));
                    continue;
                }
                None => continue,
            };
            match self.entry(index, event, is_fifo(&url)) {
                Ok(entry) => match queues.iter_mut().find(|(u, _)| *u == url) {
                    Some((_, entries)) => entries.push(entry),
                    None => queues.push((url, vec![entry])),
                },
                Err(e) => outcomes[index] = Some(Outcome::Failed(e)),
            }
        }
        let sent = futures_util::future::join_all(
            queues
                .into_iter()
                .map(|(url, entries)| async move { self.send_queue(&url, entries).await }),
        )
        .await;
        for (index, outcome) in sent.into_iter().flatten() {
            if let Some(slot) = outcomes.get_mut(index) {
                *slot = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retryable("sqs: event was not sent")))
            .collect()
    }

    async fn check(&self) -> Result<(), PublishError> {
        let url = match &self.routing.default_queue {
            Some(queue) => {
                let target = crate::routing::parse_target(queue)
                    .map_err(|e| PublishError::permanent(e.to_string()))?;
                Some(self.resolve(&target).await?)
            }
            None => None,
        };
        let result = match url {
            Some(url) => self
                .client
                .get_queue_attributes()
                .queue_url(&url)
                .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| classify(&e, &format!("GetQueueAttributes {url}"))),
            None => self
                .client
                .list_queues()
                .max_results(1)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| classify(&e, "ListQueues")),
        };
        // Readiness and the relay's outage probe: any failure means "not ready now".
        result.map_err(|e| PublishError::unavailable(e.message))
    }
}

/// Split into `SendMessageBatch` calls: at most 10 entries and `max_bytes` each.
fn chunk(entries: Vec<Entry>, max_bytes: usize) -> Vec<Vec<Entry>> {
    let mut chunks: Vec<Vec<Entry>> = Vec::new();
    let mut bytes = 0;
    for entry in entries {
        let full = chunks
            .last()
            .is_none_or(|c| c.len() == MAX_BATCH_ENTRIES || bytes + entry.size > max_bytes);
        if full {
            chunks.push(Vec::new());
            bytes = 0;
        }
        bytes += entry.size;
        if let Some(last) = chunks.last_mut() {
            last.push(entry);
        }
    }
    chunks
}

fn is_throttling(code: &str) -> bool {
    code.contains("Throttl") || code == "RequestThrottled" || code == "SlowDown"
}

/// Map an SDK error: a missing or invalid queue is permanent; no answer from the
/// endpoint (connection, timeout), refused credentials and an unavailable service
/// are the broker's failure (unavailable); everything else is retryable.
fn classify<E, R>(error: &SdkError<E, R>, what: &str) -> PublishError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    let code = error.code().unwrap_or_default();
    let detail = match error {
        SdkError::ServiceError(e) => {
            format!("{}: {}", code, e.err().message().unwrap_or("no message"))
        }
        other => {
            // Show the cause chain: "dispatch failure" alone does not say what broke.
            let mut text = other.to_string();
            let mut source = std::error::Error::source(other);
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            text
        }
    };
    let message = format!("sqs: {what}: {detail}");
    let missing_queue = matches!(
        code,
        "QueueDoesNotExist"
            | "AWS.SimpleQueueService.NonExistentQueue"
            | "InvalidAddress"
            | "AWS.SimpleQueueService.InvalidAddress"
    );
    let no_answer = matches!(
        error,
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_)
    );
    let refused_or_down = matches!(
        code,
        "InvalidClientTokenId"
            | "UnrecognizedClientException"
            | "SignatureDoesNotMatch"
            | "InvalidSignatureException"
            | "IncompleteSignature"
            | "MissingAuthenticationToken"
            | "ExpiredToken"
            | "ServiceUnavailable"
    );
    if missing_queue {
        PublishError::permanent(message)
    } else if no_answer || refused_or_down {
        PublishError::unavailable(message)
    } else {
        PublishError::retryable(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: usize, size: usize) -> Entry {
        Entry {
            index,
            aggregate_id: "a".into(),
            size,
            request: SendMessageBatchRequestEntry::builder()
                .id(index.to_string())
                .message_body("{}")
                .build()
                .unwrap(),
        }
    }

    #[test]
    fn chunks_respect_count_and_bytes() {
        let sizes = |c: &Vec<Vec<Entry>>| c.iter().map(Vec::len).collect::<Vec<_>>();
        let c = chunk((0..23).map(|i| entry(i, 10)).collect(), 1000);
        assert_eq!(sizes(&c), vec![10, 10, 3]);
        let c = chunk((0..5).map(|i| entry(i, 400)).collect(), 1000);
        assert_eq!(sizes(&c), vec![2, 2, 1]);
    }
}
