//! [`WalStore`]: the core [`Store`] over a WAL outbox's slot, so that the core
//! relay publishes the stream with the same rules as a table (per-aggregate order,
//! hold-back, retries, outage detection, metrics).
//!
//! - A reader task streams committed transactions from the slot into a bounded
//!   buffer and reconnects when the connection drops; while another process reads
//!   the slot, the server refuses it ("slot is active") and it waits as a standby.
//! - One claim at a time takes events in stream order.
//! - A failed event is parked in the outbox table (attempts, error, next attempt,
//!   or dead letter), with the events of its aggregate that followed it; later
//!   events of a parked aggregate go to the table too until the table has none of
//!   it left. A [`crate::PgStore`] relay over the same tables drains them in order.
//! - An event neither published nor parked (a broker outage, the publish deadline)
//!   goes back to the front of the buffer: nothing is acknowledged past it.
//! - The slot is acknowledged up to the end of the last transaction whose events
//!   are all published or parked; a restart resumes after it (at least once).

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgoutbox_core::{Claim, Decision, Event, Store, StoreError};
use sqlx::PgPool;
use tokio::sync::{mpsc, watch, Mutex, Notify, OwnedMutexGuard};

use super::stream::{WalEvent, WalSource, WalStream, WalStreamError};
use super::WalMessage;
use crate::sql::Sql;
use crate::tables::Tables;

/// What the reader task hands the store.
enum Incoming {
    /// A new connection: the stream starts again after the acknowledged position,
    /// so what was buffered and not resolved will come again.
    Restarted,
    Event(WalEvent),
}

/// The core store over a WAL outbox's slot; see the module documentation.
pub struct WalStore {
    pool: PgPool,
    sql: Arc<Sql>,
    name: String,
    state: Arc<Mutex<State>>,
    arrived: Arc<Notify>,
    /// Events read and not yet published or parked.
    unresolved: Arc<AtomicU64>,
    reader: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for WalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalStore")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Drop for WalStore {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

struct State {
    incoming: mpsc::Receiver<Incoming>,
    acks: watch::Sender<u64>,
    /// Bumped at each reconnect: a claim of an older generation resolves nothing.
    generation: u64,
    /// Read, not claimed, in stream order.
    buffer: VecDeque<Pending>,
    /// Transactions not yet all resolved, in stream order.
    transactions: VecDeque<Transaction>,
    /// Aggregates that had events parked in the table (still there or not).
    parked: HashSet<(String, String)>,
    /// Whether `parked` must be read from the table first: at the start and after
    /// a reconnect (another relay may have parked events meanwhile).
    reload_parked: bool,
}

struct Pending {
    event: Event,
    end_lsn: u64,
}

struct Transaction {
    end_lsn: u64,
    remaining: usize,
}

impl WalStore {
    /// A store reading `source` for the outbox of `tables` (its events' prefix),
    /// parking failed events in those tables through `pool`. Starts the reader task
    /// (call inside a Tokio runtime).
    pub fn new(pool: PgPool, tables: Tables, source: WalSource) -> Self {
        let (sender, incoming) = mpsc::channel(source.read_ahead.max(1));
        let (acks, ack_receiver) = watch::channel(0);
        let arrived = Arc::new(Notify::new());
        let prefix = WalMessage::prefix(&tables);
        let reader = tokio::spawn(read(
            source,
            prefix,
            sender,
            ack_receiver,
            Arc::clone(&arrived),
        ));
        Self {
            pool,
            sql: Arc::new(Sql::new(&tables)),
            name: format!("{}:wal", tables.outbox_name()),
            state: Arc::new(Mutex::new(State {
                incoming,
                acks,
                generation: 0,
                buffer: VecDeque::new(),
                transactions: VecDeque::new(),
                parked: HashSet::new(),
                reload_parked: true,
            })),
            arrived,
            unresolved: Arc::new(AtomicU64::new(0)),
            reader,
        }
    }
}

impl State {
    /// Take what the reader handed over; an idle report is acknowledged when
    /// nothing is outstanding (the slot then follows the server: a heartbeat).
    fn drain(&mut self, unresolved: &AtomicU64) {
        while let Ok(incoming) = self.incoming.try_recv() {
            match incoming {
                Incoming::Restarted => {
                    self.generation += 1;
                    self.reload_parked = true;
                    self.buffer.clear();
                    self.transactions.clear();
                    unresolved.store(0, Ordering::Relaxed);
                }
                Incoming::Event(WalEvent::Transaction { events, end_lsn }) => {
                    self.transactions.push_back(Transaction {
                        end_lsn,
                        remaining: events.len(),
                    });
                    unresolved.fetch_add(events.len() as u64, Ordering::Relaxed);
                    self.buffer
                        .extend(events.into_iter().map(|event| Pending { event, end_lsn }));
                }
                Incoming::Event(WalEvent::Idle { wal_end }) => {
                    if self.transactions.is_empty() {
                        self.acks.send_replace(wal_end);
                    }
                }
            }
        }
    }

    /// `count` events of the transaction ending at `end_lsn` are published or
    /// parked; acknowledge every leading transaction that is done.
    fn resolve(&mut self, end_lsn: u64, count: usize, unresolved: &AtomicU64) {
        if let Some(tx) = self.transactions.iter_mut().find(|t| t.end_lsn == end_lsn) {
            tx.remaining = tx.remaining.saturating_sub(count);
            unresolved.fetch_sub(count as u64, Ordering::Relaxed);
        }
        let mut done = None;
        while self.transactions.front().is_some_and(|t| t.remaining == 0) {
            done = self.transactions.pop_front().map(|t| t.end_lsn);
        }
        if let Some(lsn) = done {
            self.acks.send_replace(lsn);
        }
    }
}

/// A claim: events in stream order, holding the store until completed.
pub struct WalClaim {
    state: Option<OwnedMutexGuard<State>>,
    generation: u64,
    events: Vec<Event>,
    end_lsns: Vec<u64>,
    pool: PgPool,
    sql: Arc<Sql>,
    unresolved: Arc<AtomicU64>,
}

impl std::fmt::Debug for WalClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalClaim")
            .field("events", &self.events.len())
            .finish_non_exhaustive()
    }
}

/// How an event goes into the table.
struct Park<'a> {
    event: &'a Event,
    attempts: i32,
    delay: Duration,
    dead: bool,
    error: Option<&'a str>,
}

impl Park<'_> {
    fn follower(event: &Event) -> Park<'_> {
        Park {
            event,
            attempts: 0,
            delay: Duration::ZERO,
            dead: false,
            error: None,
        }
    }
}

async fn park(pool: &PgPool, sql: &Sql, parks: &[Park<'_>]) -> Result<(), StoreError> {
    if parks.is_empty() {
        return Ok(());
    }
    let column = |f: fn(&Event) -> &str| parks.iter().map(|p| f(p.event)).collect::<Vec<&str>>();
    let headers: Vec<String> = parks
        .iter()
        .map(|p| serde_json::to_string(&p.event.headers).unwrap_or_else(|_| "{}".into()))
        .collect();
    sqlx::query(&sql.wal_park)
        .bind(parks.iter().map(|p| p.event.id).collect::<Vec<_>>())
        .bind(column(|e| &e.aggregate_type))
        .bind(column(|e| &e.aggregate_id))
        .bind(column(|e| &e.event_type))
        .bind(column(Event::payload_str))
        .bind(headers)
        .bind(
            parks
                .iter()
                .map(|p| p.event.destination.as_deref())
                .collect::<Vec<_>>(),
        )
        .bind(parks.iter().map(|p| p.event.created_at).collect::<Vec<_>>())
        .bind(parks.iter().map(|p| p.attempts).collect::<Vec<_>>())
        .bind(
            parks
                .iter()
                .map(|p| i64::try_from(p.delay.as_millis()).unwrap_or(i64::MAX))
                .collect::<Vec<_>>(),
        )
        .bind(parks.iter().map(|p| p.dead).collect::<Vec<_>>())
        .bind(parks.iter().map(|p| p.error).collect::<Vec<_>>())
        .execute(pool)
        .await
        .map_err(StoreError::backend)?;
    Ok(())
}

fn key(event: &Event) -> (String, String) {
    (event.aggregate_type.clone(), event.aggregate_id.clone())
}

impl Store for WalStore {
    type Claim = WalClaim;

    async fn claim(&self, limit: usize) -> Result<WalClaim, StoreError> {
        let mut state = Arc::clone(&self.state).lock_owned().await;
        state.drain(&self.unresolved);
        if state.reload_parked {
            let rows: Vec<(String, String)> = sqlx::query_as(&self.sql.wal_parked_all)
                .fetch_all(&self.pool)
                .await
                .map_err(StoreError::backend)?;
            state.parked.extend(rows);
            state.reload_parked = false;
        }
        let mut taken: Vec<Pending> = Vec::new();
        let mut diverted: Vec<Pending> = Vec::new();
        while taken.len() < limit {
            let Some(next) = state.buffer.pop_front() else {
                break;
            };
            let aggregate = key(&next.event);
            if state.parked.contains(&aggregate) {
                let waiting = sqlx::query_scalar::<_, bool>(&self.sql.wal_parked)
                    .bind(&aggregate.0)
                    .bind(&aggregate.1)
                    .fetch_one(&self.pool)
                    .await;
                match waiting {
                    Ok(true) => {
                        diverted.push(next);
                        continue;
                    }
                    Ok(false) => {
                        state.parked.remove(&aggregate);
                    }
                    Err(error) => {
                        give_back(&mut state, taken.into_iter().chain(diverted).chain([next]));
                        return Err(StoreError::backend(error));
                    }
                }
            }
            taken.push(next);
        }
        if !diverted.is_empty() {
            let parks: Vec<Park<'_>> = diverted.iter().map(|p| Park::follower(&p.event)).collect();
            if let Err(error) = park(&self.pool, &self.sql, &parks).await {
                drop(parks);
                give_back(&mut state, taken.into_iter().chain(diverted));
                return Err(error);
            }
            for pending in &diverted {
                state.resolve(pending.end_lsn, 1, &self.unresolved);
            }
        }
        let (events, end_lsns) = taken.into_iter().map(|p| (p.event, p.end_lsn)).unzip();
        Ok(WalClaim {
            generation: state.generation,
            state: Some(state),
            events,
            end_lsns,
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
            unresolved: Arc::clone(&self.unresolved),
        })
    }

    async fn pending(&self) -> Result<u64, StoreError> {
        Ok(self.unresolved.load(Ordering::Relaxed))
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    async fn wait_for_events(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.arrived.notified()).await;
    }
}

/// Put events back at the front of the buffer, in stream order (the order given
/// need not be: they are sorted by their place in the stream).
fn give_back(state: &mut State, events: impl Iterator<Item = Pending>) {
    let mut events: Vec<Pending> = events.collect();
    events.sort_by_key(|p| p.event.seq);
    for pending in events.into_iter().rev() {
        state.buffer.push_front(pending);
    }
}

fn pending(events: Vec<Event>, end_lsns: Vec<u64>) -> impl Iterator<Item = Pending> {
    events
        .into_iter()
        .zip(end_lsns)
        .map(|(event, end_lsn)| Pending { event, end_lsn })
}

impl Claim for WalClaim {
    fn events(&self) -> &[Event] {
        &self.events
    }

    async fn complete(mut self, decisions: Vec<Decision>) -> Result<(), StoreError> {
        let mut state = self
            .state
            .take()
            .ok_or_else(|| StoreError::Invalid("WAL claim completed twice".into()))?;
        let events = std::mem::take(&mut self.events);
        let end_lsns = std::mem::take(&mut self.end_lsns);
        // Aggregates with an event parked by this claim or before: their later
        // events go to the table behind it.
        let mut parking: HashSet<(String, String)> = HashSet::new();
        let mut parks = Vec::new();
        let mut resolved = Vec::new();
        let mut unsent = Vec::new();
        for (i, decision) in decisions.iter().enumerate() {
            let Some(event) = events.get(i) else { break };
            let aggregate = key(event);
            let behind = parking.contains(&aggregate) || state.parked.contains(&aggregate);
            match decision {
                Decision::Published => resolved.push(i),
                Decision::Retry { delay, error } => {
                    parking.insert(aggregate);
                    parks.push(Park {
                        event,
                        attempts: 1,
                        delay: *delay,
                        dead: false,
                        error: Some(error),
                    });
                    resolved.push(i);
                }
                Decision::DeadLetter { error } => {
                    parking.insert(aggregate);
                    parks.push(Park {
                        event,
                        attempts: 1,
                        delay: Duration::ZERO,
                        dead: true,
                        error: Some(error),
                    });
                    resolved.push(i);
                }
                Decision::HeldBack if behind => {
                    parks.push(Park::follower(event));
                    resolved.push(i);
                }
                // Not sent (an outage, the publish deadline): read it again.
                Decision::HeldBack => unsent.push(i),
            }
        }
        // Events without a decision were not handled: read them again.
        unsent.extend(decisions.len()..events.len());
        if let Err(error) = park(&self.pool, &self.sql, &parks).await {
            // Nothing recorded: all of it is claimed again (and published again).
            drop(parks);
            if state.generation == self.generation {
                give_back(&mut state, pending(events, end_lsns));
            }
            return Err(error);
        }
        if state.generation != self.generation {
            // The stream restarted meanwhile: all of it comes again.
            return Ok(());
        }
        state.parked.extend(parking);
        for i in resolved {
            state.resolve(end_lsns[i], 1, &self.unresolved);
        }
        let unsent: HashSet<usize> = unsent.into_iter().collect();
        give_back(
            &mut state,
            pending(events, end_lsns)
                .enumerate()
                .filter(|(i, _)| unsent.contains(i))
                .map(|(_, p)| p),
        );
        Ok(())
    }

    async fn release(mut self) -> Result<(), StoreError> {
        self.give_back();
        Ok(())
    }
}

impl WalClaim {
    /// Everything claimed goes back to the front of the buffer.
    fn give_back(&mut self) {
        let Some(mut state) = self.state.take() else {
            return;
        };
        if state.generation != self.generation {
            return;
        }
        let events = std::mem::take(&mut self.events);
        let end_lsns = std::mem::take(&mut self.end_lsns);
        give_back(&mut state, pending(events, end_lsns));
    }
}

impl Drop for WalClaim {
    /// A claim dropped without being completed (its relay task was cancelled)
    /// gives its events back.
    fn drop(&mut self) {
        self.give_back();
    }
}

/// The reader task: stream the slot into the store, acknowledge what it says,
/// reconnect after a failure or while another reader holds the slot.
async fn read(
    source: WalSource,
    prefix: String,
    sender: mpsc::Sender<Incoming>,
    mut acks: watch::Receiver<u64>,
    arrived: Arc<Notify>,
) {
    // The last failure to connect, logged once while it repeats (a slot that
    // cannot be read fails every `reconnect_delay` until it is fixed; the
    // `outbox` binary reports it as not ready).
    let mut failing: Option<String> = None;
    loop {
        match WalStream::connect(&source, prefix.clone()).await {
            Ok(mut stream) => {
                failing = None;
                tracing::info!(slot = %source.slot, "reading the WAL outbox's slot");
                if sender.send(Incoming::Restarted).await.is_err() {
                    return;
                }
                // Acknowledgements of the previous connection are void: its
                // unresolved transactions come again.
                acks.mark_unchanged();
                loop {
                    tokio::select! {
                        changed = acks.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            stream.ack(*acks.borrow_and_update());
                        }
                        next = stream.next() => match next {
                            Ok(Some(event)) => {
                                if sender.send(Incoming::Event(event)).await.is_err() {
                                    return;
                                }
                                arrived.notify_one();
                            }
                            Ok(None) => break,
                            Err(error) => {
                                tracing::warn!(slot = %source.slot, %error, "WAL stream failed; reconnecting");
                                break;
                            }
                        }
                    }
                }
            }
            Err(WalStreamError::Replication(error)) if error.to_string().contains("is active") => {
                tracing::debug!(slot = %source.slot, "slot in use by another relay: standing by");
            }
            Err(error) => {
                let error = error.to_string();
                if failing.as_ref() == Some(&error) {
                    tracing::debug!(slot = %source.slot, %error, "cannot read the WAL outbox's slot");
                } else {
                    tracing::warn!(slot = %source.slot, %error, "cannot read the WAL outbox's slot; retrying every {:?} (logged again when the error changes)", source.reconnect_delay);
                    failing = Some(error);
                }
            }
        }
        if sender.is_closed() {
            return;
        }
        tokio::time::sleep(source.reconnect_delay).await;
    }
}
