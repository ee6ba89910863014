//! In-memory test doubles: a [`MemoryStore`] and a [`RecordingPublisher`].
//!
//! For unit tests of code built on the core only; the real stores and brokers
//! are tested against the real services.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::event::{Event, EventError, NewEvent};
use crate::publisher::{Outcome, PublishError, Publisher};
use crate::store::{Claim, Decision, Store, StoreError};

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Pending,
    Published,
    Dead,
}

#[derive(Debug)]
struct Row {
    event: Event,
    available_at: DateTime<Utc>,
    state: State,
    claimed: bool,
    last_error: Option<String>,
}

#[derive(Debug, Default)]
struct Rows {
    rows: Vec<Row>,
    next_seq: i64,
    /// Calls of [`Store::stopped`].
    stops: usize,
}

/// An outbox in memory, with the same claiming rules as the PostgreSQL store:
/// due events only, one claim per event at a time, and with ordering on, runs:
/// each aggregate's oldest unpublished, not dead-lettered events in order, up to
/// the first one that is not due, and nothing of an aggregate another claim holds.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    rows: Arc<Mutex<Rows>>,
    ordering: bool,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store with per-aggregate ordering on.
    pub fn new() -> Self {
        Self {
            rows: Arc::default(),
            ordering: true,
        }
    }

    /// Turn per-aggregate ordering on or off.
    #[must_use]
    pub fn with_ordering(mut self, ordering: bool) -> Self {
        self.ordering = ordering;
        self
    }

    fn lock(&self) -> MutexGuard<'_, Rows> {
        lock(&self.rows)
    }

    /// Add an event, as a committed enqueue would.
    pub fn enqueue(&self, event: NewEvent) -> Result<Uuid, EventError> {
        event.validate()?;
        let payload = serde_json::value::RawValue::from_string(event.payload).map_err(|e| {
            EventError::InvalidPayload {
                event_id: event.id,
                event_type: event.event_type.clone(),
                reason: e.to_string(),
            }
        })?;
        let mut rows = self.lock();
        rows.next_seq += 1;
        let now = Utc::now();
        let seq = rows.next_seq;
        rows.rows.push(Row {
            event: Event {
                id: event.id,
                seq,
                aggregate_type: event.aggregate_type,
                aggregate_id: event.aggregate_id,
                event_type: event.event_type,
                payload,
                headers: event.headers,
                destination: event.destination,
                created_at: now,
                attempts: 0,
            },
            available_at: event.not_before.unwrap_or(now),
            state: State::Pending,
            claimed: false,
            last_error: None,
        });
        Ok(event.id)
    }

    /// Ids of published events, in insertion order.
    pub fn published_ids(&self) -> Vec<Uuid> {
        self.ids_in(&State::Published)
    }

    /// Ids of dead-lettered events, in insertion order.
    pub fn dead_letter_ids(&self) -> Vec<Uuid> {
        self.ids_in(&State::Dead)
    }

    /// Attempts and last error of one event.
    pub fn attempts(&self, id: Uuid) -> Option<(u32, Option<String>)> {
        self.lock()
            .rows
            .iter()
            .find(|r| r.event.id == id)
            .map(|r| (r.event.attempts, r.last_error.clone()))
    }

    /// How many times a relay told this store that it stopped ([`Store::stopped`]).
    pub fn stops(&self) -> usize {
        self.lock().stops
    }

    /// Make every pending event due now (skip backoff in tests).
    pub fn make_all_due(&self) {
        let now = Utc::now();
        for row in &mut self.lock().rows {
            row.available_at = row.available_at.min(now);
        }
    }

    fn ids_in(&self, state: &State) -> Vec<Uuid> {
        self.lock()
            .rows
            .iter()
            .filter(|r| &r.state == state)
            .map(|r| r.event.id)
            .collect()
    }
}

fn lock(rows: &Mutex<Rows>) -> MutexGuard<'_, Rows> {
    // A panic in another test thread must not hide this test's result.
    rows.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Store for MemoryStore {
    type Claim = MemoryClaim;

    fn ordered(&self) -> bool {
        self.ordering
    }

    async fn claim(&self, limit: usize) -> Result<MemoryClaim, StoreError> {
        let now = Utc::now();
        let mut rows = self.lock();
        // Aggregates whose run ended: a row not due, or held by another claim.
        let mut closed: HashSet<(String, String)> = HashSet::new();
        let mut events = Vec::new();
        for row in &mut rows.rows {
            if events.len() >= limit {
                break;
            }
            if row.state != State::Pending {
                continue;
            }
            let takeable = !row.claimed && row.available_at <= now;
            if !self.ordering {
                if takeable {
                    row.claimed = true;
                    events.push(row.event.clone());
                }
                continue;
            }
            let key = (
                row.event.aggregate_type.clone(),
                row.event.aggregate_id.clone(),
            );
            if closed.contains(&key) {
                continue;
            }
            if takeable {
                row.claimed = true;
                events.push(row.event.clone());
            } else {
                closed.insert(key);
            }
        }
        Ok(MemoryClaim {
            rows: Arc::clone(&self.rows),
            events,
        })
    }

    async fn pending(&self) -> Result<u64, StoreError> {
        Ok(self.ids_in(&State::Pending).len() as u64)
    }

    async fn stopped(&self) {
        self.lock().stops += 1;
    }
}

/// A batch claimed from a [`MemoryStore`]; dropping it releases the events.
#[derive(Debug)]
pub struct MemoryClaim {
    rows: Arc<Mutex<Rows>>,
    events: Vec<Event>,
}

impl Claim for MemoryClaim {
    fn events(&self) -> &[Event] {
        &self.events
    }

    async fn complete(self, decisions: Vec<Decision>) -> Result<(), StoreError> {
        if decisions.len() != self.events.len() {
            return Err(StoreError::Invalid(format!(
                "{} decisions for {} events",
                decisions.len(),
                self.events.len()
            )));
        }
        let now = Utc::now();
        let mut rows = lock(&self.rows);
        for (event, decision) in self.events.iter().zip(decisions) {
            let Some(row) = rows.rows.iter_mut().find(|r| r.event.id == event.id) else {
                continue;
            };
            if decision == Decision::HeldBack {
                continue;
            }
            row.event.attempts += 1;
            match decision {
                Decision::Published => row.state = State::Published,
                Decision::Retry { delay, error } => {
                    row.available_at = now + delay;
                    row.last_error = Some(error);
                }
                Decision::DeadLetter { error } => {
                    row.state = State::Dead;
                    row.last_error = Some(error);
                }
                Decision::HeldBack => {}
            }
        }
        Ok(())
    }
}

impl Drop for MemoryClaim {
    fn drop(&mut self) {
        let mut rows = lock(&self.rows);
        let ids: HashSet<Uuid> = self.events.iter().map(|e| e.id).collect();
        for row in rows.rows.iter_mut().filter(|r| ids.contains(&r.event.id)) {
            row.claimed = false;
        }
    }
}

type FailRule = Box<dyn Fn(&Event) -> Option<PublishError> + Send + Sync>;

/// Records every event it publishes; can be told to fail some.
pub struct RecordingPublisher {
    published: Mutex<Vec<Event>>,
    calls: AtomicUsize,
    fail: FailRule,
}

impl Default for RecordingPublisher {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for RecordingPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordingPublisher")
            .field("calls", &self.calls)
            .finish_non_exhaustive()
    }
}

impl RecordingPublisher {
    /// A publisher that accepts everything.
    pub fn new() -> Self {
        Self::failing_when(|_| None)
    }

    /// A publisher that fails an event when `rule` returns an error for it.
    pub fn failing_when(
        rule: impl Fn(&Event) -> Option<PublishError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            published: Mutex::default(),
            calls: AtomicUsize::new(0),
            fail: Box::new(rule),
        }
    }

    /// A publisher that fails the first publish of the event `id` with a retryable
    /// error `message`, and accepts everything else (that event's later publishes
    /// included).
    pub fn failing_once(id: Uuid, message: &'static str) -> Self {
        let failed = std::sync::atomic::AtomicBool::new(false);
        Self::failing_when(move |e| {
            (e.id == id && !failed.swap(true, Ordering::SeqCst))
                .then(|| PublishError::retryable(message))
        })
    }

    /// Events published so far, in publish order.
    pub fn published(&self) -> Vec<Event> {
        self.published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Ids of events published so far, in publish order.
    pub fn published_ids(&self) -> Vec<Uuid> {
        self.published().iter().map(|e| e.id).collect()
    }

    /// Number of `publish` calls.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Publisher for RecordingPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        events
            .iter()
            .map(|event| match (self.fail)(event) {
                Some(error) => Outcome::Failed(error),
                None => {
                    published.push(event.clone());
                    Outcome::Published
                }
            })
            .collect()
    }
}

/// Run `relay` while `work` runs, then shut it down gracefully (stop claiming,
/// finish the batch in flight). `None` when both did not finish within `limit`.
pub async fn run_relay_while<S: Store, P: Publisher, T>(
    relay: &crate::Relay<S, P>,
    work: impl std::future::Future<Output = T>,
    limit: std::time::Duration,
) -> Option<T> {
    let stop = tokio::sync::Notify::new();
    let run = async {
        let ((), out) = tokio::join!(relay.run(stop.notified()), async {
            let out = work.await;
            stop.notify_one();
            out
        });
        out
    };
    tokio::time::timeout(limit, run).await.ok()
}

/// Claim batch after batch with [`crate::Relay::run_once`] until the store has
/// nothing pending, for at most `limit`. Returns what went wrong otherwise.
pub async fn drain<S: Store, P: Publisher>(
    relay: &crate::Relay<S, P>,
    limit: std::time::Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let report = relay.run_once().await.map_err(|e| e.to_string())?;
        if report.claimed == 0 {
            if relay.store().pending().await.map_err(|e| e.to_string())? == 0 {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("outbox not drained within {limit:?}"));
        }
    }
}

/// Check per-aggregate order on the consumer's side: in `arrivals` (message ids in
/// the order they arrived, duplicates included), the first arrival of each id of a
/// run in `runs` (one aggregate's ids in insertion order) comes in the run's order,
/// and every id arrived. Returns what is wrong otherwise.
pub fn check_first_arrivals(arrivals: &[Uuid], runs: &[Vec<Uuid>]) -> Result<(), String> {
    let mut seen = HashSet::new();
    let first: Vec<Uuid> = arrivals
        .iter()
        .copied()
        .filter(|id| seen.insert(*id))
        .collect();
    for run in runs {
        let members: HashSet<&Uuid> = run.iter().collect();
        let got: Vec<Uuid> = first
            .iter()
            .copied()
            .filter(|id| members.contains(id))
            .collect();
        if &got != run {
            return Err(format!(
                "first arrivals of a run: {got:?}, inserted as {run:?}"
            ));
        }
    }
    Ok(())
}

/// For outage tests: wait (at most `limit`) until the relay sees the broker down,
/// then keep the outage going for `outage` and check that the relay still sees it.
pub async fn hold_outage(
    health: &crate::BrokerHealth,
    outage: std::time::Duration,
    limit: std::time::Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + limit;
    while health.is_up() {
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "the relay did not see the broker down within {limit:?}"
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    tokio::time::sleep(outage).await;
    if health.is_up() {
        return Err(format!("the outage ended by itself: {:?}", health.status()));
    }
    Ok(())
}

/// The socket address of a broker URL such as `nats://127.0.0.1:4222` or
/// `http://localhost:5000/`: its host and port (after the scheme and any user, before
/// any path), resolved (the first address), e.g. to put a proxy in front of the
/// broker. Panics when it does not resolve.
pub fn resolve_url(url: &str) -> std::net::SocketAddr {
    let after_scheme = url.rsplit("://").next().unwrap_or(url);
    let authority = after_scheme.split('/').next().unwrap_or(after_scheme);
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    std::net::ToSocketAddrs::to_socket_addrs(host_port)
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| panic!("cannot resolve the address of {url}"))
}

/// `prefix` and a fresh UUID: a name (topic, queue, stream) no other test uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", Uuid::new_v4().simple())
}

/// A variable a test script exports (a CA's path, a broker's address); a missing
/// one fails the test with how to get it (`script` sets it; scripts/test.sh runs it).
pub fn exported(name: &str, script: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the tests with scripts/test.sh ({script} sets it)")
    })
}

/// The event most tests write: `order.created` on the `order` aggregate
/// `aggregate`, with the payload `{"n": n}`.
pub fn event(aggregate: &str, n: usize) -> NewEvent {
    NewEvent::new(
        "order",
        aggregate,
        "order.created",
        &serde_json::json!({ "n": n }),
    )
}

/// `per_aggregate` [`event`]s on each of `aggregates` aggregates named
/// `<prefix><a>`, interleaved: the first event of every aggregate, then the second
/// of every aggregate, and so on; an event's `n` is its place in its aggregate.
pub fn interleaved_events(prefix: &str, aggregates: usize, per_aggregate: usize) -> Vec<NewEvent> {
    (0..per_aggregate)
        .flat_map(|n| (0..aggregates).map(move |a| event(&format!("{prefix}{a}"), n)))
        .collect()
}

/// The event ids of messages read back from a broker, in their order, taken with
/// the adapter's `event_id`; panics at a message that carries none.
pub fn event_ids<M, E: std::fmt::Display>(
    messages: &[M],
    event_id: impl Fn(&M) -> Result<Uuid, E>,
) -> Vec<Uuid> {
    messages
        .iter()
        .map(|m| event_id(m).unwrap_or_else(|e| panic!("a message without an event id: {e}")))
        .collect()
}
