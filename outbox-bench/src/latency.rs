//! Commit-to-publish latency at a fixed offered rate.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_core::{Event, Outcome, Publisher, Relay, RelayConfig};
use serde_json::json;
use uuid::Uuid;

use crate::db::{is_drained, produce_at_rate, Bench};
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

/// Notes when each event reached `publish` (a null publisher otherwise).
#[derive(Clone, Default)]
pub(crate) struct Stamping {
    seen: Arc<Mutex<Vec<(Uuid, Instant)>>>,
}

impl Stamping {
    /// How many events were published.
    pub(crate) fn count(&self) -> usize {
        self.seen.lock().map(|s| s.len()).unwrap_or(0)
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
        let now = Instant::now();
        if let Ok(mut seen) = self.seen.lock() {
            seen.extend(events.iter().map(|e| (e.id, now)));
        }
        vec![Outcome::Published; events.len()]
    }
}

struct Percentiles {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    count: usize,
    offered: f64,
}

async fn measure(bench: &Bench, mode: Mode, rate: u64, duration: Duration) -> Result<Percentiles> {
    let store = bench.store(3).await?.with_wakeup(mode.wakeup());
    let publisher = Stamping::default();
    let relay = Relay::new(store.clone(), publisher.clone()).with_config(RelayConfig::default());
    let committed: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let producer = async {
        // Let the relay start (and the listener connect) before offering load.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let total = rate * duration.as_secs();
        let started = Instant::now();
        let stamps = produce_at_rate(bench, rate, total).await?;
        if let Ok(mut c) = committed.lock() {
            *c = stamps;
        }
        let offered = total as f64 / started.elapsed().as_secs_f64();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !is_drained(&store).await && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = stop_tx.send(());
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(offered)
    };
    let (offered, ()) = tokio::join!(
        producer,
        relay.run(async {
            let _ = stop_rx.await;
        })
    );
    let offered = offered?;

    let published = publisher.published();
    let committed = committed.lock().map(|c| c.clone()).unwrap_or_default();
    let millis = commit_to_publish_millis(&committed, &published)?;
    Ok(Percentiles {
        p50: quantile(&millis, 0.50),
        p90: quantile(&millis, 0.90),
        p99: quantile(&millis, 0.99),
        max: millis.last().copied().unwrap_or(0.0),
        count: millis.len(),
        offered,
    })
}

/// Milliseconds from each commit to its event's publish, sorted; an error when an
/// event was not published. The publish may see an event before the producer's
/// commit call returned: 0.
pub(crate) fn commit_to_publish_millis(
    committed: &[(Uuid, Instant)],
    published: &HashMap<Uuid, Instant>,
) -> Result<Vec<f64>> {
    let mut millis: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| published.get(id).map(|p| p.saturating_duration_since(*at)))
        .map(|d| d.as_secs_f64() * 1000.0)
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

/// The `q` quantile of sorted values (0 when there are none).
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
    sorted.get(i).copied().unwrap_or(0.0)
}

/// Latency percentiles per wake-up mode.
pub(crate) async fn latency(url: &str, args: &LatencyArgs) -> Result<Report> {
    let bench = Bench::fresh(url).await?;
    let duration = Duration::from_secs(args.duration_secs.max(1));
    let mut results = Vec::new();
    for &mode in &args.modes {
        bench.reset().await?;
        if mode == Mode::Notify {
            pgoutbox_postgres::install_notify_trigger(&bench.pool, &bench.tables).await?;
        }
        progress(format!("{} at {} events/s", mode.name(), args.rate));
        let p = measure(&bench, mode, args.rate, duration).await?;
        progress(format!(
            "{}: p50 {:.2} ms p99 {:.2} ms max {:.2} ms",
            mode.name(),
            p.p50,
            p.p99,
            p.max
        ));
        if mode == Mode::Notify {
            pgoutbox_postgres::remove_notify_trigger(&bench.pool, &bench.tables).await?;
        }
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
