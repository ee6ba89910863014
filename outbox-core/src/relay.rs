//! The relay engine: claim a batch, publish it concurrently, record every outcome, repeat.
//!
//! Events of one aggregate in a claim are published one after the other and the
//! rest of an aggregate's run is held back after a failure (module `waves`);
//! different aggregates are published concurrently.
//!
//! A failure of the broker as a whole ([`FailureKind::Unavailable`]) counts no
//! attempt: the relay stops claiming and probes the broker until it answers
//! (module `broker_health`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::broker_health::{BrokerHealth, BrokerStatus, Change};
use crate::event::Event;
use crate::liveness::Liveness;
use crate::publisher::{FailureKind, Outcome, PublishError, Publisher, RunOrder, RunOutcome};
use crate::retry::{backoff, RetryPolicy};
use crate::store::{Claim, Decision, Store, StoreError};
use crate::telemetry;
use crate::waves::Waves;

/// How a [`Relay`] runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
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
    /// First pause before probing a broker that failed as a whole; later probes of the
    /// same outage wait twice as long each time (with jitter), up to
    /// `broker_probe_max`. Defaults to 500 ms.
    pub broker_probe_min: Duration,
    /// Longest pause between two probes of a broker that is down, and so the longest
    /// time events wait after it is back before claiming resumes. Defaults to 5 s: a
    /// probe is one request (no traffic at all while a NATS client is disconnected),
    /// and with the earlier 30 s one relay resumed up to 27 s after the broker came
    /// back from a 60 s outage (0.1-27 s in four runs of `outbox-bench live
    /// --outage-secs 60`).
    pub broker_probe_max: Duration,
    /// Distinct event types that get their own `event_type` label on the failure
    /// counters; later ones are counted as `other` ([`telemetry::EventTypeLabels`]).
    /// Defaults to 100.
    pub event_type_labels: usize,
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
            broker_probe_min: Duration::from_millis(500),
            broker_probe_max: Duration::from_secs(5),
            event_type_labels: 100,
        }
    }
}

/// Builder-style setters: the struct is `#[non_exhaustive]` (fields may be added),
/// so outside this crate it is built from [`RelayConfig::default`] with these (or by
/// assigning its public fields), not with a struct expression.
impl RelayConfig {
    /// Set [`RelayConfig::batch_size`].
    #[must_use]
    pub fn batch_size(mut self, value: usize) -> Self {
        self.batch_size = value;
        self
    }

    /// Set [`RelayConfig::poll_interval`].
    #[must_use]
    pub fn poll_interval(mut self, value: Duration) -> Self {
        self.poll_interval = value;
        self
    }

    /// Set [`RelayConfig::publish_timeout`].
    #[must_use]
    pub fn publish_timeout(mut self, value: Duration) -> Self {
        self.publish_timeout = value;
        self
    }

    /// Set [`RelayConfig::retry`].
    #[must_use]
    pub fn retry(mut self, value: RetryPolicy) -> Self {
        self.retry = value;
        self
    }

    /// Set [`RelayConfig::workers`].
    #[must_use]
    pub fn workers(mut self, value: usize) -> Self {
        self.workers = value;
        self
    }

    /// Set [`RelayConfig::pending_refresh`].
    #[must_use]
    pub fn pending_refresh(mut self, value: Duration) -> Self {
        self.pending_refresh = value;
        self
    }

    /// Set [`RelayConfig::error_backoff`].
    #[must_use]
    pub fn error_backoff(mut self, value: Duration) -> Self {
        self.error_backoff = value;
        self
    }

    /// Set [`RelayConfig::broker_probe_min`].
    #[must_use]
    pub fn broker_probe_min(mut self, value: Duration) -> Self {
        self.broker_probe_min = value;
        self
    }

    /// Set [`RelayConfig::broker_probe_max`].
    #[must_use]
    pub fn broker_probe_max(mut self, value: Duration) -> Self {
        self.broker_probe_max = value;
        self
    }

    /// Set [`RelayConfig::event_type_labels`].
    #[must_use]
    pub fn event_type_labels(mut self, value: usize) -> Self {
        self.event_type_labels = value;
        self
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
    deferred: AtomicU64,
    store_errors: AtomicU64,
}

/// A copy of [`RelayStats`] at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Events left pending without an attempt because the broker was unavailable.
    pub deferred: u64,
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
            deferred: self.deferred.load(Ordering::Relaxed),
            store_errors: self.store_errors.load(Ordering::Relaxed),
        }
    }

    /// Count what a recorded batch did.
    fn count_batch(&self, report: &BatchReport) {
        for (counter, events) in [
            (&self.published, report.published),
            (&self.retried, report.retried),
            (&self.dead_lettered, report.dead_lettered),
            (&self.held_back, report.held_back),
            (&self.deferred, report.deferred),
        ] {
            counter.fetch_add(events as u64, Ordering::Relaxed);
        }
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Events left pending without an attempt because the broker was unavailable.
    pub deferred: usize,
}

/// Moves events from a [`Store`] to a [`Publisher`], at least once.
///
/// ```no_run
/// # async fn demo<S: pgoutbox_core::Store, P: pgoutbox_core::Publisher>(store: S, publisher: P) {
/// use pgoutbox_core::{Relay, RelayConfig};
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
    broker: Arc<BrokerHealth>,
    event_types: telemetry::EventTypeLabels,
    /// The `outbox` label of every metric ([`Store::name`], or [`Relay::with_name`]).
    outbox: metrics::SharedString,
}

impl<S: Store, P: Publisher> Relay<S, P> {
    /// A relay with the default [`RelayConfig`].
    pub fn new(store: S, publisher: P) -> Self {
        let outbox = metrics::SharedString::from(std::sync::Arc::<str>::from(store.name()));
        Self {
            outbox,
            store,
            publisher,
            config: RelayConfig::default(),
            stats: Arc::default(),
            liveness: Arc::default(),
            broker: Arc::default(),
            event_types: telemetry::EventTypeLabels::default(),
        }
    }

    /// Use this configuration.
    #[must_use]
    pub fn with_config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// Name the outbox `name` in metrics (`outbox` label) and logs instead of the
    /// store's [`Store::name`].
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.outbox = metrics::SharedString::from(std::sync::Arc::<str>::from(name.into()));
        self
    }

    /// The outbox's name in metrics and logs.
    pub fn name(&self) -> &str {
        &self.outbox
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

    /// Whether the broker takes messages, as this relay last saw it (for readiness
    /// checks); the handle stays valid while the relay runs.
    pub fn broker_health(&self) -> Arc<BrokerHealth> {
        Arc::clone(&self.broker)
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
    /// While the broker is down (a batch failed with [`FailureKind::Unavailable`]),
    /// no loop claims; [`Publisher::check`] is probed with capped backoff until it
    /// passes.
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send) {
        telemetry::describe();
        metrics::gauge!(telemetry::BROKER_UP, "outbox" => self.outbox.clone())
            .set(if self.broker.is_up() { 1.0 } else { 0.0 });
        let stop = Stop::new();
        let watch = async {
            shutdown.await;
            tracing::info!("outbox relay: shutdown requested; finishing batches in flight");
            stop.cancel();
        };
        let loops = self.config.workers.max(1);
        self.liveness.started(loops, Instant::now());
        let workers =
            futures_util::future::join_all((0..loops).map(|worker| self.work(worker, &stop)));
        // Every log line of the loops names the outbox (several may run in one process).
        let span = tracing::info_span!("outbox.relay", outbox = &*self.outbox);
        async {
            tokio::join!(
                watch,
                workers,
                self.refresh_pending(&stop),
                self.probe_broker(&stop)
            );
            self.store.stopped().await;
            self.liveness.stopped();
            tracing::info!("outbox relay: stopped");
        }
        .instrument(span)
        .await;
    }

    async fn work(&self, worker: usize, stop: &Stop) {
        while !stop.is_cancelled() {
            self.cycle(stop).await;
            self.liveness.finished_cycle(worker, Instant::now());
        }
    }

    /// One claim and what follows it: publishing and recording, the wait for new
    /// events, or the pause after a store error. While the broker is down, a cycle
    /// is a wait (at most `poll_interval`) for the probe to pass.
    async fn cycle(&self, stop: &Stop) {
        if self.broker.is_down() {
            unless_stopped(stop, self.broker.wait_claimable(self.config.poll_interval)).await;
            return;
        }
        match self.run_once().await {
            // Something was there: more may be, claim again at once.
            Ok(report) if report.claimed > 0 => {}
            Ok(_) => {
                // The probe passed and there is nothing to publish: the outage is over.
                self.tell(self.broker.settled(Instant::now()));
                unless_stopped(stop, self.store.wait_for_events(self.config.poll_interval)).await;
            }
            Err(error) => {
                tracing::error!(%error, "outbox relay: store error; retrying");
                unless_stopped(stop, tokio::time::sleep(self.config.error_backoff)).await;
            }
        }
    }

    /// While the broker is down, probe it with capped backoff and jitter; when it
    /// answers, let the claim loops go on.
    async fn probe_broker(&self, stop: &Stop) {
        let mut outage = None;
        let mut probes = 0u32;
        while !stop.is_cancelled() {
            let mut since = None;
            unless_stopped(stop, async { since = Some(self.broker.wait_down().await) }).await;
            let Some(since) = since else { break };
            if outage != Some(since) {
                outage = Some(since);
                probes = 0;
            }
            probes = probes.saturating_add(1);
            let pause = backoff(
                self.config.broker_probe_min,
                self.config.broker_probe_max,
                probes,
            );
            unless_stopped(stop, tokio::time::sleep(pause)).await;
            if stop.is_cancelled() {
                break;
            }
            let limit = self.config.publish_timeout;
            match tokio::time::timeout(limit, self.publisher.check()).await {
                Ok(Ok(())) => {
                    tracing::debug!(probes, "outbox relay: broker check passed; claiming again");
                    self.broker.answered();
                }
                Ok(Err(error)) => {
                    tracing::debug!(probes, %error, "outbox relay: broker check failed")
                }
                Err(_) => {
                    tracing::debug!(
                        probes,
                        "outbox relay: broker check got no answer within {limit:?}"
                    )
                }
            }
        }
    }

    /// Log and export a change of the broker's state, once per change.
    fn tell(&self, change: Change) {
        match change {
            Change::None => {}
            Change::WentDown => {
                metrics::gauge!(telemetry::BROKER_UP, "outbox" => self.outbox.clone()).set(0.0);
                if let BrokerStatus::Down { reason, .. } = self.broker.status() {
                    tracing::error!(
                        error = %reason,
                        "outbox relay: broker unavailable; claiming paused until it answers \
                         (the outage counts no attempt against events)"
                    );
                }
            }
            Change::CameBack(outage) => {
                metrics::gauge!(telemetry::BROKER_UP, "outbox" => self.outbox.clone()).set(1.0);
                tracing::info!(
                    outage_ms = u64::try_from(outage.as_millis()).unwrap_or(u64::MAX),
                    "outbox relay: broker available again; claiming resumed"
                );
            }
        }
    }

    async fn refresh_pending(&self, stop: &Stop) {
        while !stop.is_cancelled() {
            match self.store.pending().await {
                Ok(n) => {
                    metrics::gauge!(telemetry::EVENTS_PENDING, "outbox" => self.outbox.clone())
                        .set(n as f64)
                }
                Err(error) => tracing::warn!(%error, "outbox relay: cannot count pending events"),
            }
            unless_stopped(stop, tokio::time::sleep(self.config.pending_refresh)).await;
        }
    }

    /// Claim one batch, publish it, record the outcomes.
    ///
    /// On a store error while recording, the claim is released and its events
    /// will be claimed again (and published again: at least once).
    pub async fn run_once(&self) -> Result<BatchReport, StoreError> {
        self.stats.claims.fetch_add(1, Ordering::Relaxed);
        let claiming = Instant::now();
        let claim = match self.store.claim(self.config.batch_size).await {
            Ok(claim) => {
                metrics::histogram!(telemetry::CLAIM_DURATION, "outbox" => self.outbox.clone())
                    .record(claiming.elapsed().as_secs_f64());
                claim
            }
            Err(error) => {
                self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                return Err(error);
            }
        };
        if claim.events().is_empty() {
            return Ok(BatchReport::default());
        }
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        let span = tracing::info_span!(
            "outbox.batch",
            outbox = &*self.outbox,
            // Signed: OpenTelemetry has no unsigned integers (a u64 field becomes a string).
            events = count(claim.events().len()),
            published = tracing::field::Empty,
            retried = tracing::field::Empty,
            dead_lettered = tracing::field::Empty,
            held_back = tracing::field::Empty,
            deferred = tracing::field::Empty,
        );
        #[cfg(feature = "opentelemetry")]
        crate::trace_context::link_events(&span, claim.events().iter().map(|e| &e.headers));
        let result = self.process(claim).instrument(span.clone()).await;
        if let Ok(report) = &result {
            span.record("published", count(report.published));
            span.record("retried", count(report.retried));
            span.record("dead_lettered", count(report.dead_lettered));
            span.record("held_back", count(report.held_back));
            span.record("deferred", count(report.deferred));
        }
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
        // One broker-wide failure makes the batch's retryable failures part of the
        // outage too: none of them counts an attempt.
        let outage = outcomes
            .iter()
            .flatten()
            .filter_map(Outcome::error)
            .find(|e| e.is_unavailable())
            .map(|e| e.message.clone());
        let now = Utc::now();
        let decisions: Vec<Decision> = events
            .iter()
            .zip(outcomes)
            .map(|(event, outcome)| {
                let decision = match outcome {
                    Some(Outcome::Failed(error)) if outage.is_some() && error.is_retryable() => {
                        report.deferred += 1;
                        Decision::HeldBack
                    }
                    Some(outcome) => self.decide(event, outcome),
                    None => {
                        report.held_back += 1;
                        Decision::HeldBack
                    }
                };
                match &decision {
                    Decision::Published => {
                        report.published += 1;
                        let lag = (now - event.created_at).num_microseconds().unwrap_or(0);
                        metrics::histogram!(telemetry::PUBLISH_LAG, "outbox" => self.outbox.clone()).record(lag as f64 / 1e6);
                    }
                    Decision::Retry { .. } => report.retried += 1,
                    Decision::DeadLetter { .. } => report.dead_lettered += 1,
                    Decision::HeldBack => {}
                }
                decision
            })
            .collect();
        // Told before recording, so that the other claim loops stop claiming sooner.
        let change = match &outage {
            Some(reason) => self.broker.failed(reason, Instant::now()),
            None if report.published > 0 => self.broker.took_message(Instant::now()),
            None => self.broker.settled(Instant::now()),
        };
        self.tell(change);
        claim.complete(decisions).await?;

        metrics::counter!(telemetry::EVENTS_PUBLISHED, "outbox" => self.outbox.clone())
            .increment(report.published as u64);
        metrics::histogram!(telemetry::BATCH_DURATION, "outbox" => self.outbox.clone())
            .record(started.elapsed().as_secs_f64());
        self.stats.count_batch(&report);
        if report.held_back > 0 {
            metrics::counter!(telemetry::EVENTS_HELD_BACK, "outbox" => self.outbox.clone())
                .increment(report.held_back as u64);
        }
        tracing::debug!(
            published = report.published,
            retried = report.retried,
            dead_lettered = report.dead_lettered,
            held_back = report.held_back,
            deferred = report.deferred,
            "outbox batch recorded"
        );
        Ok(report)
    }

    /// Publish the claim in waves (module `waves`) within `publish_timeout`:
    /// one outcome per event, `None` for an event held back behind a failure of its
    /// aggregate or not sent before the deadline. A store without per-aggregate
    /// ordering ([`Store::ordered`]) has its claim published in one call.
    async fn publish(&self, events: &[Event]) -> Vec<Option<Outcome>> {
        let timeout = self.config.publish_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let waves = self
            .store
            .ordered()
            .then(|| Waves::of(events))
            .filter(|waves| waves.len() > 1);
        let Some(waves) = waves else {
            // No order to keep, or one event per aggregate: the claim is a single
            // wave, sent as it is.
            return self
                .publish_wave(events, deadline, timeout)
                .await
                .into_iter()
                .map(Some)
                .collect();
        };
        if self.publisher.run_order() == RunOrder::Pipelined {
            return self.publish_runs(events, &waves, deadline, timeout).await;
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
            // A wave of consecutive claim events (one hot aggregate, or runs
            // interleaved in turn) is published from the claim as it is; only a
            // scattered wave is copied.
            let copied: Vec<Event>;
            let batch: &[Event] = if wave.windows(2).all(|w| w[1] == w[0] + 1) {
                &events[wave[0]..wave[0] + wave.len()]
            } else {
                copied = wave.iter().map(|&i| events[i].clone()).collect();
                &copied
            };
            let results = self.publish_wave(batch, deadline, timeout).await;
            let outage = results
                .iter()
                .filter_map(Outcome::error)
                .any(PublishError::is_unavailable);
            for (i, outcome) in wave.into_iter().zip(results) {
                if outcome != Outcome::Published {
                    failed_runs[waves.run_of(i)] = true;
                }
                outcomes[i] = Some(outcome);
            }
            if outage {
                // The broker is down: later waves would fail the same way.
                break;
            }
        }
        outcomes
    }

    /// Publish the claim through a pipelining publisher: every run of several events
    /// in its own [`Publisher::publish_run`] call, the single events together in one
    /// [`Publisher::publish`] call, all at once and bounded by `deadline`. A run's
    /// events after its failed one are held back (`None`).
    async fn publish_runs(
        &self,
        events: &[Event],
        waves: &Waves,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Vec<Option<Outcome>> {
        let (runs, singles): (Vec<Vec<usize>>, Vec<Vec<usize>>) = waves
            .runs_members()
            .into_iter()
            .partition(|run| run.len() > 1);
        let singles: Vec<usize> = singles.into_iter().flatten().collect();
        let single_events = gather(events, &singles);
        let single_outcomes = async {
            if singles.is_empty() {
                Vec::new()
            } else {
                self.publish_call(&single_events, deadline, timeout).await
            }
        };
        let run_outcomes = futures_util::future::join_all(runs.iter().map(|run| async move {
            let batch = gather(events, run);
            let outcome =
                match tokio::time::timeout_at(deadline, self.publisher.publish_run(&batch)).await {
                    Ok(outcome) => outcome,
                    // The broker may have taken a head of the run: it is published
                    // again from its first event, in order.
                    Err(_) => RunOutcome::failed(
                        0,
                        PublishError::retryable(format!(
                            "publish did not finish within {timeout:?}"
                        )),
                    ),
                };
            run_outcomes(run.len(), outcome)
        }));
        let (single_outcomes, run_outcomes) = tokio::join!(single_outcomes, run_outcomes);
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        for (i, outcome) in singles.iter().zip(single_outcomes) {
            outcomes[*i] = Some(outcome);
        }
        for (run, results) in runs.iter().zip(run_outcomes) {
            for (i, outcome) in run.iter().zip(results) {
                outcomes[*i] = outcome;
            }
        }
        let all_failed = outcomes.iter().flatten().all(|o| o != &Outcome::Published);
        if all_failed {
            self.failures_of_broker(outcomes.iter_mut().flatten(), timeout)
                .await;
        }
        outcomes
    }

    /// One publisher call, bounded by `deadline`; always one outcome per event.
    ///
    /// A wave in which nothing was published and some event failed retryably (a
    /// wave that timed out as a whole, too) is checked ([`Publisher::check`]): if
    /// the broker fails the check, the retryable failures were the broker's, not the
    /// messages'. If it passes, they count as attempts: a message that makes every
    /// publish hang still reaches its dead letter.
    async fn publish_wave(
        &self,
        events: &[Event],
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Vec<Outcome> {
        let mut outcomes = self.publish_call(events, deadline, timeout).await;
        if outcomes.iter().all(|o| o != &Outcome::Published) {
            self.failures_of_broker(outcomes.iter_mut(), timeout).await;
        }
        outcomes
    }

    /// One [`Publisher::publish`] call bounded by `deadline`: one outcome per event.
    async fn publish_call(
        &self,
        events: &[Event],
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Vec<Outcome> {
        let mut outcomes =
            match tokio::time::timeout_at(deadline, self.publisher.publish(events)).await {
                Ok(outcomes) => outcomes,
                Err(_) => {
                    let reason = format!("publish did not finish within {timeout:?}");
                    vec![Outcome::retryable(reason); events.len()]
                }
            };
        if outcomes.len() != events.len() {
            let reason = format!(
                "publisher returned {} outcomes for {} events",
                outcomes.len(),
                events.len()
            );
            outcomes.resize(events.len(), Outcome::retryable(reason));
        }
        outcomes
    }

    /// Nothing of a call went through: if some failure is retryable and the broker
    /// fails [`Publisher::check`], the retryable failures were the broker's.
    async fn failures_of_broker<'a>(
        &self,
        outcomes: impl Iterator<Item = &'a mut Outcome>,
        timeout: Duration,
    ) {
        let mut retryable: Vec<&mut Outcome> = outcomes
            .filter(|o| o.error().is_some_and(|e| e.kind == FailureKind::Retryable))
            .collect();
        if retryable.is_empty() {
            return;
        }
        if let Some(reason) = self.broker_fails_check(timeout).await {
            for outcome in &mut retryable {
                if let Outcome::Failed(error) = &**outcome {
                    **outcome =
                        Outcome::unavailable(format!("{} (broker check: {reason})", error.message));
                }
            }
        }
    }

    /// `Some(reason)` if the broker fails [`Publisher::check`] within `limit`.
    async fn broker_fails_check(&self, limit: Duration) -> Option<String> {
        match tokio::time::timeout(limit, self.publisher.check()).await {
            Ok(Ok(())) => None,
            Ok(Err(error)) => Some(error.message),
            Err(_) => Some(format!("no answer within {limit:?}")),
        }
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
        let event_type = self
            .event_types
            .label(&event.event_type, self.config.event_type_labels);
        metrics::counter!(telemetry::EVENTS_FAILED, "outbox" => self.outbox.clone(), "event_type" => event_type.clone())
            .increment(1);
        let give_up = match error.kind {
            FailureKind::Permanent => Some(format!("permanent: {}", error.message)),
            FailureKind::Retryable if self.config.retry.exhausted(attempt) => Some(format!(
                "gave up after {attempt} attempts: {}",
                error.message
            )),
            FailureKind::Retryable => None,
            // `process` defers an outage's events before deciding: never dead-lettered.
            FailureKind::Unavailable => None,
        };
        match give_up {
            Some(error) => {
                metrics::counter!(telemetry::EVENTS_DEAD_LETTERED, "outbox" => self.outbox.clone(), "event_type" => event_type)
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
type Stop = CancellationToken;

/// Wait for `fut`, or less if shutdown is triggered meanwhile.
async fn unless_stopped(stop: &Stop, fut: impl Future<Output = ()>) {
    stop.run_until_cancelled(fut).await;
}

/// The events of `events` at `indices`, in that order.
fn gather(events: &[Event], indices: &[usize]) -> Vec<Event> {
    indices.iter().map(|&i| events[i].clone()).collect()
}

/// A run's per-event outcomes from its [`RunOutcome`]: the published head, the
/// failed event, `None` (held back) for the rest.
fn run_outcomes(len: usize, outcome: RunOutcome) -> Vec<Option<Outcome>> {
    let published = outcome.published.min(len);
    let mut outcomes: Vec<Option<Outcome>> = vec![Some(Outcome::Published); published];
    if published < len {
        let error = outcome.failure.unwrap_or_else(|| {
            PublishError::retryable(format!(
                "publisher stopped the run after {published} of {len} events without an error"
            ))
        });
        outcomes.push(Some(Outcome::Failed(error)));
        outcomes.resize(len, None);
    }
    outcomes
}

/// A count as a span field value (see `run_once`).
fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
