//! Commit-to-publish latency at a fixed offered rate.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_core::{DynPublisher, Event, NullPublisher, Outcome, Publisher, RunOrder, RunOutcome};
use serde_json::json;
use uuid::Uuid;

use crate::db::{is_drained, produce_at_rate, run_while, Bench};
use crate::stats::{latency_millis, Percentiles};
use crate::{progress, verdict, Mode, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct LatencyArgs {
    /// Offered rate, events per second (one event per transaction).
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of offered load per mode.
    #[arg(long, default_value_t = 30)]
    duration_secs: u64,
    /// Wake-up modes to measure.
    #[arg(long, value_delimiter = ',', default_values = ["fixed", "adaptive", "notify"])]
    modes: Vec<Mode>,
}

/// Notes when each event was acknowledged by the publisher it wraps (by default a
/// null one, which acknowledges every event at once).
#[derive(Clone)]
pub(crate) struct Stamping {
    inner: Arc<dyn DynPublisher>,
    seen: Arc<Mutex<Vec<(Uuid, Instant)>>>,
}

impl Default for Stamping {
    fn default() -> Self {
        Self::over(Arc::new(NullPublisher))
    }
}

impl Stamping {
    /// Stamping the events `inner` publishes.
    pub(crate) fn over(inner: Arc<dyn DynPublisher>) -> Self {
        Self {
            inner,
            seen: Arc::default(),
        }
    }

    /// How many events were published.
    pub(crate) fn count(&self) -> usize {
        self.seen.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// Wait until `n` events were published (at most `limit`); the time it took.
    pub(crate) async fn wait_for(&self, n: usize, limit: Duration) -> Result<Duration> {
        let started = Instant::now();
        while self.count() < n {
            if started.elapsed() > limit {
                return Err(format!(
                    "only {} of {n} events published within {limit:?}",
                    self.count()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(started.elapsed())
    }

    /// When each event was published.
    pub(crate) fn published(&self) -> HashMap<Uuid, Instant> {
        self.seen
            .lock()
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }
}

impl Publisher for Stamping {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let outcomes = self.inner.publish_boxed(events).await;
        let now = Instant::now();
        let published = events
            .iter()
            .zip(&outcomes)
            .filter(|(_, o)| matches!(o, Outcome::Published))
            .map(|(e, _)| (e.id, now));
        self.stamp(published);
        outcomes
    }

    fn run_order(&self) -> RunOrder {
        self.inner.run_order_dyn()
    }

    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        let outcome = self.inner.publish_run_boxed(run).await;
        let now = Instant::now();
        self.stamp(
            run[..outcome.published.min(run.len())]
                .iter()
                .map(|e| (e.id, now)),
        );
        outcome
    }
}

impl Stamping {
    fn stamp(&self, published: impl Iterator<Item = (Uuid, Instant)>) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.extend(published);
        }
    }
}

struct ModeLatency {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    count: usize,
    offered: f64,
}

async fn measure(bench: &Bench, mode: Mode, rate: u64, duration: Duration) -> Result<ModeLatency> {
    let publisher = Stamping::default();
    let relay = bench.relay(mode, publisher.clone()).await?;
    let (committed, offered) = run_while(&relay, async {
        // Let the relay start (and the listener connect) before offering load.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let total = rate * duration.as_secs();
        let started = Instant::now();
        let committed = produce_at_rate(&bench.pool, &bench.outbox, rate, total).await?;
        let offered = total as f64 / started.elapsed().as_secs_f64();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !is_drained(relay.store()).await && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((committed, offered))
    })
    .await?;

    let millis = commit_to_publish_millis(&committed, &publisher.published())?;
    let count = millis.len();
    let p = Percentiles::of(millis);
    Ok(ModeLatency {
        p50: p.at(0.50),
        p90: p.at(0.90),
        p99: p.at(0.99),
        max: p.max(),
        count,
        offered,
    })
}

/// Commit-to-publish milliseconds of each committed event, sorted (the one
/// definition of [`crate::stats::latency_millis`]); an error when an event was not
/// published.
pub(crate) fn commit_to_publish_millis(
    committed: &[(Uuid, Instant)],
    published: &HashMap<Uuid, Instant>,
) -> Result<Vec<f64>> {
    let mut millis: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| published.get(id).map(|p| latency_millis(*at, *p)))
        .collect();
    if millis.len() != committed.len() {
        return Err(format!(
            "{} of {} committed events were not published",
            committed.len() - millis.len(),
            committed.len()
        )
        .into());
    }
    millis.sort_by(f64::total_cmp);
    Ok(millis)
}

/// Latency percentiles per wake-up mode.
pub(crate) async fn latency(url: &str, args: &LatencyArgs) -> Result<Report> {
    let bench = Bench::fresh(url).await?;
    let duration = Duration::from_secs(args.duration_secs.max(1));
    let mut results = Vec::new();
    for &mode in &args.modes {
        progress(format!("{} at {} events/s", mode.name(), args.rate));
        let p = bench
            .in_mode(mode, measure(&bench, mode, args.rate, duration))
            .await?;
        progress(format!(
            "{}: p50 {:.2} ms p99 {:.2} ms max {:.2} ms",
            mode.name(),
            p.p50,
            p.p99,
            p.max
        ));
        results.push((mode, p));
    }
    let default_p99 = results
        .iter()
        .find(|(m, _)| *m == Mode::Adaptive)
        .map(|(_, p)| p.p99);
    let parts: Vec<String> = results
        .iter()
        .map(|(m, p)| {
            format!(
                "{} p50 {:.2} p90 {:.2} p99 {:.2} max {:.1} ms",
                m.name(),
                p.p50,
                p.p90,
                p.p99,
                p.max
            )
        })
        .collect();
    let target = match default_p99 {
        Some(p99) => format!(
            "default (adaptive-poll) p99 {p99:.2} ms, target <= 5 ms: {}",
            verdict(p99 <= 5.0)
        ),
        None => "default mode not measured".to_string(),
    };
    Ok(Report {
        line: format!(
            "latency: {} events/s for {} s, commit-to-publish: {}; {target}",
            args.rate,
            duration.as_secs(),
            parts.join("; ")
        ),
        json: json!({
            "scenario": "latency", "rate": args.rate, "seconds": duration.as_secs(),
            "modes": results.iter().map(|(m, p)| json!({
                "mode": m.name(), "p50_ms": p.p50, "p90_ms": p.p90, "p99_ms": p.p99,
                "max_ms": p.max, "events": p.count, "offered_per_s": p.offered,
            })).collect::<Vec<_>>(),
            "default_p99_ms": default_p99,
            "target_met": default_p99.map(|p| p <= 5.0),
        }),
    })
}
