//! The relay engine: claim a batch, publish it concurrently, record every outcome, repeat.
//!
//! Events of one aggregate in a claim are published one after the other and the
//! rest of an aggregate's run is held back after a failure (module `waves`);
//! different aggregates are published concurrently.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio::sync::Notify;
use tracing::Instrument;

use crate::event::Event;
use crate::liveness::Liveness;
use crate::publisher::{FailureKind, Outcome, Publisher};
use crate::retry::RetryPolicy;
use crate::store::{Claim, Decision, Store, StoreError};
use crate::telemetry;
use crate::waves::Waves;

/// How a [`Relay`] runs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Most events claimed and published at once. Defaults to 200.
    pub batch_size: usize,
    /// Longest wait for new events when the outbox is empty. Defaults to 100 ms.
    /// A store with a wake-up channel may return earlier.
    pub poll_interval: Duration,
    /// Longest time a batch may take to publish; unfinished messages count as
    /// retryable failures. Defaults to 30 s.
    pub publish_timeout: Duration,
    /// Backoff and maximum attempts for failed events.
    pub retry: RetryPolicy,
    /// Claim loops run concurrently by this relay, each with its own batch. Defaults to 1.
    pub workers: usize,
    /// How often the pending gauge is refreshed. Defaults to 5 s.
    pub pending_refresh: Duration,
    /// Pause after a store error before claiming again. Defaults to 1 s.
    pub error_backoff: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch_size: 200,
            poll_interval: Duration::from_millis(100),
            publish_timeout: Duration::from_secs(30),
            retry: RetryPolicy::default(),
            workers: 1,
            pending_refresh: Duration::from_secs(5),
            error_backoff: Duration::from_secs(1),
        }
    }
}

/// Counters of what a relay did, readable while it runs.
#[derive(Debug, Default)]
pub struct RelayStats {
    claims: AtomicU64,
    batches: AtomicU64,
    published: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    held_back: AtomicU64,
    store_errors: AtomicU64,
}

/// A copy of [`RelayStats`] at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStatsSnapshot {
    /// Claim calls, including those that found nothing.
    pub claims: u64,
    /// Claims that returned at least one event.
    pub batches: u64,
    /// Events published and recorded.
    pub published: u64,
    /// Failed events scheduled for another attempt.
    pub retried: u64,
    /// Events dead-lettered.
    pub dead_lettered: u64,
    /// Events held back behind a failed event of their aggregate (left pending).
    pub held_back: u64,
    /// Claims or records that failed in the store.
    pub store_errors: u64,
}

impl RelayStats {
    /// Read all counters.
    pub fn snapshot(&self) -> RelayStatsSnapshot {
        RelayStatsSnapshot {
            claims: self.claims.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            published: self.published.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            held_back: self.held_back.load(Ordering::Relaxed),
            store_errors: self.store_errors.load(Ordering::Relaxed),
        }
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// Events published.
    pub published: usize,
    /// Events scheduled for retry.
    pub retried: usize,
    /// Events dead-lettered.
    pub dead_lettered: usize,
    /// Events held back behind a failed event of their aggregate (left pending).
    pub held_back: usize,
}

/// Moves events from a [`Store`] to a [`Publisher`], at least once.
///
/// ```no_run
/// # async fn demo<S: outbox_core::Store, P: outbox_core::Publisher>(store: S, publisher: P) {
/// use outbox_core::{Relay, RelayConfig};
/// let relay = Relay::new(store, publisher).with_config(RelayConfig::default());
/// relay.run(async { let _ = tokio::signal::ctrl_c().await; }).await;
/// # }
/// ```
pub struct Relay<S, P> {
    store: S,
    publisher: P,
    config: RelayConfig,
    stats: Arc<RelayStats>,
    liveness: Arc<Liveness>,
}

impl<S: Store, P: Publisher> Relay<S, P> {
    /// A relay with the default [`RelayConfig`].
    pub fn new(store: S, publisher: P) -> Self {
        Self {
            store,
            publisher,
            config: RelayConfig::default(),
            stats: Arc::default(),
            liveness: Arc::default(),
        }
    }

    /// Use this configuration.
    #[must_use]
    pub fn with_config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// The configuration in use.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Counters of what this relay did; the handle stays valid while the relay runs.
    pub fn stats(&self) -> Arc<RelayStats> {
        Arc::clone(&self.stats)
    }

    /// When each claim loop last finished a cycle, for a liveness probe; the handle
    /// stays valid while the relay runs.
    pub fn liveness(&self) -> Arc<Liveness> {
        Arc::clone(&self.liveness)
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The publisher.
    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    /// Run until `shutdown` completes, then stop claiming, finish the batches in
    /// flight and return.
    ///
    /// A full batch is followed at once by the next claim; the relay waits for new
    /// events ([`Store::wait_for_events`], at most `poll_interval`) only when a claim
    /// found nothing. Store errors are logged and retried after `error_backoff`.
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send) {
        telemetry::describe();
        let stop = Stop::default();
        let watch = async {
            shutdown.await;
            tracing::info!("outbox relay: shutdown requested; finishing batches in flight");
            stop.trigger();
        };
        let loops = self.config.workers.max(1);
        self.liveness.started(loops, Instant::now());
        let workers =
            futures_util::future::join_all((0..loops).map(|worker| self.work(worker, &stop)));
        tokio::join!(watch, workers, self.refresh_pending(&stop));
        self.liveness.stopped();
        tracing::info!("outbox relay: stopped");
    }

    async fn work(&self, worker: usize, stop: &Stop) {
        while !stop.is_triggered() {
            self.cycle(stop).await;
            self.liveness.finished_cycle(worker, Instant::now());
        }
    }

    /// One claim and what follows it: publishing and recording, the wait for new
    /// events, or the pause after a store error.
    async fn cycle(&self, stop: &Stop) {
        match self.run_once().await {
            // Something was there: more may be, claim again at once.
            Ok(report) if report.claimed > 0 => {}
            Ok(_) => {
                stop.or(self.store.wait_for_events(self.config.poll_interval))
                    .await;
            }
            Err(error) => {
                tracing::error!(%error, "outbox relay: store error; retrying");
                stop.or(tokio::time::sleep(self.config.error_backoff)).await;
            }
        }
    }

    async fn refresh_pending(&self, stop: &Stop) {
        while !stop.is_triggered() {
            match self.store.pending().await {
                Ok(n) => metrics::gauge!(telemetry::EVENTS_PENDING).set(n as f64),
                Err(error) => tracing::warn!(%error, "outbox relay: cannot count pending events"),
            }
            stop.or(tokio::time::sleep(self.config.pending_refresh))
                .await;
        }
    }

    /// Claim one batch, publish it, record the outcomes.
    ///
    /// On a store error while recording, the claim is released and its events
    /// will be claimed again (and published again: at least once).
    pub async fn run_once(&self) -> Result<BatchReport, StoreError> {
        self.stats.claims.fetch_add(1, Ordering::Relaxed);
        let claim = match self.store.claim(self.config.batch_size).await {
            Ok(claim) => claim,
            Err(error) => {
                self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                return Err(error);
            }
        };
        if claim.events().is_empty() {
            return Ok(BatchReport::default());
        }
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        let span = tracing::debug_span!("outbox.batch", size = claim.events().len());
        let result = self.process(claim).instrument(span).await;
        if result.is_err() {
            self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    async fn process(&self, claim: S::Claim) -> Result<BatchReport, StoreError> {
        let started = Instant::now();
        let events = claim.events();
        let outcomes = self.publish(events).await;
        let mut report = BatchReport {
            claimed: events.len(),
            ..BatchReport::default()
        };
        let now = Utc::now();
        let decisions: Vec<Decision> = events
            .iter()
            .zip(outcomes)
            .map(|(event, outcome)| {
                let decision = match outcome {
                    Some(outcome) => self.decide(event, outcome),
                    None => Decision::HeldBack,
                };
                match &decision {
                    Decision::Published => {
                        report.published += 1;
                        let lag = (now - event.created_at).num_microseconds().unwrap_or(0);
                        metrics::histogram!(telemetry::PUBLISH_LAG).record(lag as f64 / 1e6);
                    }
                    Decision::Retry { .. } => report.retried += 1,
                    Decision::DeadLetter { .. } => report.dead_lettered += 1,
                    Decision::HeldBack => report.held_back += 1,
                }
                decision
            })
            .collect();
        claim.complete(decisions).await?;

        metrics::counter!(telemetry::EVENTS_PUBLISHED).increment(report.published as u64);
        metrics::histogram!(telemetry::BATCH_DURATION).record(started.elapsed().as_secs_f64());
        self.stats
            .published
            .fetch_add(report.published as u64, Ordering::Relaxed);
        self.stats
            .retried
            .fetch_add(report.retried as u64, Ordering::Relaxed);
        self.stats
            .dead_lettered
            .fetch_add(report.dead_lettered as u64, Ordering::Relaxed);
        if report.held_back > 0 {
            metrics::counter!(telemetry::EVENTS_HELD_BACK).increment(report.held_back as u64);
            self.stats
                .held_back
                .fetch_add(report.held_back as u64, Ordering::Relaxed);
        }
        tracing::debug!(
            published = report.published,
            retried = report.retried,
            dead_lettered = report.dead_lettered,
            held_back = report.held_back,
            "outbox batch recorded"
        );
        Ok(report)
    }

    /// Publish the claim in waves (module `waves`) within `publish_timeout`:
    /// one outcome per event, `None` for an event held back behind a failure of its
    /// aggregate or not sent before the deadline.
    async fn publish(&self, events: &[Event]) -> Vec<Option<Outcome>> {
        let timeout = self.config.publish_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let waves = Waves::of(events);
        if waves.len() <= 1 {
            // One event per aggregate: the claim is a single wave, sent as it is.
            return self
                .publish_wave(events, deadline, timeout)
                .await
                .into_iter()
                .map(Some)
                .collect();
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        let mut failed_runs = vec![false; waves.runs()];
        for k in 0..waves.len() {
            let wave: Vec<usize> = waves
                .wave(k)
                .iter()
                .copied()
                .filter(|&i| !failed_runs[waves.run_of(i)])
                .collect();
            if wave.is_empty() || tokio::time::Instant::now() >= deadline {
                break;
            }
            let batch: Vec<Event> = wave.iter().map(|&i| events[i].clone()).collect();
            let results = self.publish_wave(&batch, deadline, timeout).await;
            for (i, outcome) in wave.into_iter().zip(results) {
                if outcome != Outcome::Published {
                    failed_runs[waves.run_of(i)] = true;
                }
                outcomes[i] = Some(outcome);
            }
        }
        outcomes
    }

    /// One publisher call, bounded by `deadline`; always one outcome per event.
    async fn publish_wave(
        &self,
        events: &[Event],
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Vec<Outcome> {
        // A timeout leaves no outcomes: every event counts as a retryable failure below.
        let mut outcomes = tokio::time::timeout_at(deadline, self.publisher.publish(events))
            .await
            .unwrap_or_default();
        if outcomes.len() != events.len() {
            let reason = if outcomes.is_empty() {
                format!("publish did not finish within {timeout:?}")
            } else {
                format!(
                    "publisher returned {} outcomes for {} events",
                    outcomes.len(),
                    events.len()
                )
            };
            outcomes.resize(events.len(), Outcome::retryable(reason));
        }
        outcomes
    }

    fn decide(&self, event: &Event, outcome: Outcome) -> Decision {
        let error = match outcome {
            Outcome::Published => {
                tracing::trace!(
                    event_id = %event.id,
                    event_type = %event.event_type,
                    aggregate_id = %event.aggregate_id,
                    attempt = event.attempts + 1,
                    "published"
                );
                return Decision::Published;
            }
            Outcome::Failed(error) => error,
        };
        let attempt = event.attempts.saturating_add(1);
        metrics::counter!(telemetry::EVENTS_FAILED, "event_type" => event.event_type.clone())
            .increment(1);
        let give_up = match error.kind {
            FailureKind::Permanent => Some(format!("permanent: {}", error.message)),
            FailureKind::Retryable if self.config.retry.exhausted(attempt) => Some(format!(
                "gave up after {attempt} attempts: {}",
                error.message
            )),
            FailureKind::Retryable => None,
        };
        match give_up {
            Some(error) => {
                metrics::counter!(
                    telemetry::EVENTS_DEAD_LETTERED,
                    "event_type" => event.event_type.clone()
                )
                .increment(1);
                tracing::error!(
                    event_id = %event.id,
                    event_type = %event.event_type,
                    aggregate_id = %event.aggregate_id,
                    attempt,
                    %error,
                    "dead-lettered"
                );
                Decision::DeadLetter { error }
            }
            None => {
                let delay = self.config.retry.delay(attempt);
                tracing::warn!(
                    event_id = %event.id,
                    event_type = %event.event_type,
                    aggregate_id = %event.aggregate_id,
                    attempt,
                    error = %error.message,
                    retry_in_ms = delay.as_millis() as u64,
                    "publish failed; will retry"
                );
                Decision::Retry {
                    delay,
                    error: error.message,
                }
            }
        }
    }
}

/// Shutdown signal shared by the relay's loops.
#[derive(Default)]
struct Stop {
    triggered: AtomicBool,
    notify: Notify,
}

impl Stop {
    fn trigger(&self) {
        self.triggered.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn is_triggered(&self) -> bool {
        self.triggered.load(Ordering::SeqCst)
    }

    /// Wait for `fut`, or less if shutdown is triggered meanwhile.
    async fn or(&self, fut: impl Future<Output = ()>) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        // Register before checking the flag so a trigger in between is not missed.
        notified.as_mut().enable();
        if self.is_triggered() {
            return;
        }
        tokio::select! {
            () = notified => {}
            () = fut => {}
        }
    }
}
