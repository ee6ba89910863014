//! Resource scenarios: the relay's peak memory and an idle relay's cost.

use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_core::{NullPublisher, RelayConfig, RelayStats};
use serde_json::json;

use crate::db::{event, run_relays, run_while, Bench};
use crate::{progress, verdict, Mode, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct RssArgs {
    /// Backlog drained by the measured relay process.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Events per claim; default: the relay's default.
    #[arg(long)]
    batch_size: Option<usize>,
    /// WAL mode: the backlog is written to the WAL and drained from a slot.
    #[arg(long)]
    wal: bool,
}

#[derive(Args, Debug)]
pub(crate) struct RssChildArgs {
    #[arg(long)]
    events: u64,
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    wal: bool,
}

/// A `kB` field of `/proc/self/status`.
fn status_kb(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Fill a backlog, then drain it in a child process and report its peak RSS.
pub(crate) async fn rss(url: &str, args: &RssArgs) -> Result<Report> {
    let bench = Bench::fresh(url).await?;
    if args.wal {
        bench.reset().await?;
        crate::wal::fresh_slot(&bench).await?;
        crate::wal::emit_backlog(&bench, args.events).await?;
    } else {
        bench.backlog(args.events, 10_000).await?;
    }
    progress("draining in a child relay process");
    let exe = std::env::current_exe()?;
    let mut command = std::process::Command::new(exe);
    command
        .arg("--database-url")
        .arg(url)
        .arg("rss-child")
        .arg("--events")
        .arg(args.events.to_string());
    if let Some(batch) = args.batch_size {
        command.arg("--batch-size").arg(batch.to_string());
    }
    if args.wal {
        command.arg("--wal");
    }
    let output = tokio::task::spawn_blocking(move || command.output()).await??;
    if args.wal {
        crate::wal::drop_slot(&bench).await?;
    }
    if !output.status.success() {
        return Err(format!(
            "relay process failed: {}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let child: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or("{}"))?;
    let hwm_kb = child["vm_hwm_kb"].as_u64().unwrap_or(0);
    let start_kb = child["start_rss_kb"].as_u64().unwrap_or(0);
    let rate = child["events_per_s"].as_f64().unwrap_or(0.0);
    let mb = hwm_kb as f64 / 1024.0;
    Ok(Report {
        line: format!(
            "rss: {} relay process peak RSS {mb:.1} MB (VmHWM; {:.1} MB after connecting) \
             draining {} events at {rate:.0} events/s (target <= 64 MB: {})",
            if args.wal { "WAL mode" } else { "table mode" },
            start_kb as f64 / 1024.0,
            args.events,
            verdict(mb <= 64.0)
        ),
        json: json!({
            "scenario": "rss", "mode": if args.wal { "wal" } else { "table" },
            "events": args.events, "vm_hwm_kb": hwm_kb,
            "start_rss_kb": start_kb, "events_per_s": rate, "target_met": mb <= 64.0,
        }),
    })
}

/// The measured process: a relay draining `events`, then its VmHWM as JSON.
pub(crate) async fn rss_child(url: &str, args: &RssChildArgs) -> Result<()> {
    let bench = Bench::existing(url).await?;
    let store = bench.store(2).await?;
    let start_rss_kb = status_kb("VmRSS:").unwrap_or(0);
    let mut config = RelayConfig::default();
    if let Some(batch) = args.batch_size {
        config.batch_size = batch;
    }
    let elapsed = if args.wal {
        drain_wal(&bench, config, args.events).await?
    } else {
        run_relays(&store, NullPublisher, 1, &config, args.events).await?
    };
    println!(
        "{}",
        json!({
            "vm_hwm_kb": status_kb("VmHWM:").unwrap_or(0),
            "start_rss_kb": start_rss_kb,
            "events_per_s": args.events as f64 / elapsed.as_secs_f64(),
        })
    );
    Ok(())
}

/// Drain `events` from the benchmark's slot with a WAL relay; the elapsed time.
async fn drain_wal(bench: &Bench, config: RelayConfig, events: u64) -> Result<std::time::Duration> {
    let mut source =
        pgoutbox_postgres::wal::WalSource::new(&bench.url, crate::wal::SLOT, crate::wal::SLOT);
    source.status_interval = std::time::Duration::from_millis(200);
    let store =
        pgoutbox_postgres::wal::WalStore::new(bench.pool.clone(), bench.tables.clone(), source);
    let relay = pgoutbox_core::Relay::new(store, NullPublisher).with_config(config.workers(1));
    let started = std::time::Instant::now();
    let deadline = started + std::time::Duration::from_secs(600);
    let stats = relay.stats();
    relay
        .run(async {
            while stats.snapshot().published < events && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
        .await;
    if stats.snapshot().published < events {
        return Err(format!(
            "only {} of {events} events drained",
            stats.snapshot().published
        )
        .into());
    }
    Ok(started.elapsed())
}

#[derive(Args, Debug)]
pub(crate) struct IdleArgs {
    /// Seconds measured per mode.
    #[arg(long, default_value_t = 10)]
    duration_secs: u64,
    /// Events per second trickled in while measuring (0: idle).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Wake-up modes to measure.
    #[arg(long, value_delimiter = ',', default_values = ["fixed", "adaptive", "notify"])]
    modes: Vec<Mode>,
}

/// CPU seconds (user + system) of the processes whose `comm` is `name`, or of this process.
fn cpu_seconds(name: Option<&str>) -> f64 {
    let ticks = 100.0; // USER_HZ on Linux
    let read = |path: &std::path::Path| -> Option<f64> {
        let stat = std::fs::read_to_string(path).ok()?;
        let (head, rest) = stat.rsplit_once(')')?;
        if let Some(name) = name {
            if head.split_once('(')?.1 != name {
                return None;
            }
        }
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: f64 = fields.get(11)?.parse().ok()?;
        let stime: f64 = fields.get(12)?.parse().ok()?;
        Some((utime + stime) / ticks)
    };
    match name {
        None => read(std::path::Path::new("/proc/self/stat")).unwrap_or(0.0),
        Some(_) => std::fs::read_dir("/proc")
            .map(|dir| {
                dir.filter_map(|e| e.ok())
                    .filter_map(|e| read(&e.path().join("stat")))
                    .sum()
            })
            .unwrap_or(0.0),
    }
}

/// With `stats` those of a running relay: after half a second, measure for
/// `duration` its claims per second, this process's CPU and all PostgreSQL
/// processes' CPU (percent of one core), while offering `rate` events per second.
async fn measured(
    bench: &Bench,
    stats: &RelayStats,
    rate: u64,
    duration: Duration,
) -> Result<(f64, f64, f64)> {
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (claims0, own0, pg0) = (
        stats.snapshot().claims,
        cpu_seconds(None),
        cpu_seconds(Some("postgres")),
    );
    let started = Instant::now();
    let mut i = 0;
    while started.elapsed() < duration {
        if rate == 0 {
            tokio::time::sleep(duration.saturating_sub(started.elapsed())).await;
            continue;
        }
        let mut tx = bench.pool.begin().await?;
        bench.outbox.enqueue(&mut tx, &event(i, 10_000)).await?;
        tx.commit().await?;
        i += 1;
        tokio::time::sleep(Duration::from_secs_f64(1.0 / rate as f64)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let claims = (stats.snapshot().claims - claims0) as f64 / seconds;
    let own = (cpu_seconds(None) - own0) / seconds * 100.0;
    let pg = (cpu_seconds(Some("postgres")) - pg0) / seconds * 100.0;
    Ok((claims, own, pg))
}

/// Claims per second and CPU of a relay with nothing (or a trickle) to publish.
pub(crate) async fn idle(url: &str, args: &IdleArgs) -> Result<Report> {
    let bench = Bench::fresh(url).await?;
    let duration = Duration::from_secs(args.duration_secs.max(1));
    let mut results = Vec::new();
    for &mode in &args.modes {
        let measure = async {
            let relay = bench.relay(mode, NullPublisher).await?;
            let stats = relay.stats();
            progress(format!("{} idle, {} events/s", mode.name(), args.rate));
            run_while(&relay, measured(&bench, &stats, args.rate, duration)).await
        };
        let (claims, own, pg) = bench.in_mode(mode, measure).await?;
        results.push((mode, claims, own, pg));
    }
    let parts: Vec<String> = results
        .iter()
        .map(|(m, claims, own, pg)| {
            format!(
                "{} {claims:.1} claims/s, bench process {own:.1}% CPU, all postgres processes {pg:.1}% CPU",
                m.name()
            )
        })
        .collect();
    Ok(Report {
        line: format!(
            "idle: {} events/s trickle for {} s: {}",
            args.rate,
            duration.as_secs(),
            parts.join("; ")
        ),
        json: json!({
            "scenario": "idle", "rate": args.rate, "seconds": duration.as_secs(),
            "modes": results.iter().map(|(m, claims, own, pg)| json!({
                "mode": m.name(), "claims_per_s": claims, "process_cpu_pct": own,
                "postgres_cpu_pct": pg,
            })).collect::<Vec<_>>(),
        }),
    })
}
