//! Fairness of a `RelayGroup`: one tenant with a large backlog and many small
//! tenants with live traffic, relayed by one group on one pool.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_core::{DynPublisher, Relay, RelayConfig};
use pgoutbox_postgres::{Outbox, PgStore, RelayGroup, Tables, Wakeup};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};
use uuid::Uuid;

use crate::db::{event_of, fill_outbox, run_while, Keys};
use crate::latency::{commit_to_publish_millis, Stamping};
use crate::stats::percentile;
use crate::{progress, verdict, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct GroupArgs {
    /// Tenant schemas (`outbox_bench_t<i>`, dropped and created again); tenant 0
    /// has the backlog, the others live traffic.
    #[arg(long, default_value_t = 50)]
    tenants: usize,
    /// Events waiting in tenant 0 when the group starts.
    #[arg(long, default_value_t = 200_000)]
    backlog: u64,
    /// Events per second offered to each small tenant, one per transaction.
    #[arg(long, default_value_t = 10)]
    rate: u64,
    /// The group's connection budget: its pool's size.
    #[arg(long, default_value_t = 8)]
    connections: u32,
    /// For comparison: the same relays on the same pool, each with its own
    /// adaptive wake-up probe, instead of a `RelayGroup`'s shared one.
    #[arg(long)]
    separate_probes: bool,
    /// Prepared statements kept per connection of the relays' pools: 1000, as the
    /// `outbox` binary gives a process relaying several outboxes (sqlx's default
    /// is 100; 50 tenants use several statements each).
    #[arg(long, default_value_t = 1000)]
    statement_cache: usize,
    /// Tenant 0's backlog waits when the relays start (a relay process restarted
    /// on a backlog: its start is inside the drain) instead of being committed at
    /// once while they run.
    #[arg(long)]
    at_start: bool,
}

fn tenant(i: usize) -> Result<Tables> {
    Ok(Tables::in_schema(&format!("outbox_bench_t{i}"))?)
}

/// Drop and create every tenant schema, migrated.
async fn fresh_tenants(pool: &PgPool, n: usize) -> Result<Vec<Tables>> {
    let mut all = Vec::with_capacity(n);
    for i in 0..n {
        let tables = tenant(i)?;
        sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            tables.schema().quoted()
        ))
        .execute(pool)
        .await?;
        pgoutbox_postgres::migrate(pool, &tables).await?;
        all.push(tables);
    }
    Ok(all)
}

/// Write `n` events over 10,000 aggregates into `tables` (as `Bench::fill` does),
/// then analyse the table (as a relay would find a backlog left while it was down).
async fn fill(url: &str, pool: &PgPool, tables: &Tables, n: u64) -> Result<()> {
    let outbox = Outbox::new(tables.clone());
    fill_outbox(url, &outbox, n, &Keys::Uniform(10_000)).await?;
    sqlx::query(&format!(
        "ANALYZE {}.{}",
        tables.schema().quoted(),
        tables.events().quoted()
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// How the tenants are relayed in one measured phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// One `RelayGroup` for every tenant on one pool: what is measured.
    Group,
    /// The same relays on the same pool, each with its own wake-up probe.
    SeparateProbes,
    /// Tenant 0 on a relay and a pool of its own, the others in a group on
    /// another pool of the same size: a dedicated relay under the same live
    /// traffic, the baseline the group is held against.
    Dedicated,
}

/// When tenant 0's backlog appears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arrival {
    /// Waiting when the relays start: a relay process (re)started on a backlog,
    /// its start (every outbox's first claims, statements prepared on every
    /// connection) inside the measured drain.
    AtStart,
    /// Committed at once (one transaction, a bulk import) while the relays have
    /// been running with the live traffic for [`SETTLE`]: the backlog drains
    /// beside relays in their steady state.
    WhileRunning,
}

/// How long the relays run with the live traffic before a backlog arrives
/// [`Arrival::WhileRunning`].
const SETTLE: Duration = Duration::from_secs(2);

/// What one phase measured.
struct Phase {
    /// Tenant 0's backlog drain rate, events/s, from its commit (or the relays'
    /// start) to its last event published.
    big_rate: f64,
    /// Commit-to-publish of the live events committed while the backlog drained,
    /// sorted.
    millis: Vec<f64>,
    /// The p99 of the live events committed in each half second of the phase's
    /// first [`WINDOWS`] half seconds (from the relays' start).
    by_half_second: Vec<f64>,
}

/// How many half seconds of the phase's start are reported one by one.
const WINDOWS: u32 = 6;

/// Write `n` events into `tables` in one transaction, so that they appear at once;
/// the instant just before its COMMIT was sent.
async fn commit_backlog(url: &str, tables: &Tables, n: u64) -> Result<Instant> {
    let outbox = Outbox::new(tables.clone());
    let keys = Keys::Uniform(10_000).draw(n);
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let mut tx = conn.begin().await?;
    for from in (0..n).step_by(5000) {
        let events: Vec<_> = (from..(from + 5000).min(n))
            .map(|i| event_of(i, keys[i as usize]))
            .collect();
        outbox.enqueue_many(&mut tx, &events).await?;
    }
    // The latency clock starts just before COMMIT is sent.
    let stamped = Instant::now();
    tx.commit().await?;
    Ok(stamped)
}

/// Start the relays as `layout` says with tenant 0's backlog arriving as `arrival`
/// says, offer live events to the other tenants until the backlog is drained.
async fn phase(
    url: &str,
    admin: &PgPool,
    all: &[Tables],
    args: &GroupArgs,
    (layout, arrival): (Layout, Arrival),
    relay_pool: &dyn Fn() -> Result<PgPool>,
) -> Result<Phase> {
    let limit = Duration::from_secs(60 + args.backlog / 1000) + SETTLE;
    if arrival == Arrival::AtStart {
        fill(url, admin, &all[0], args.backlog).await?;
    }
    // Tenant 0's publisher apart, to see its backlog's end.
    let (backlog_stamps, stamping) = (Stamping::default(), Stamping::default());
    let pool = relay_pool()?;
    let mut group = RelayGroup::new();
    let mut alone = RelayGroup::new();
    let others_pool = relay_pool()?;
    for (i, tables) in all.iter().enumerate() {
        let stamps = if i == 0 { &backlog_stamps } else { &stamping };
        let publisher: Arc<dyn DynPublisher> = Arc::new(stamps.clone());
        let (target, pool) = match (layout, i) {
            (Layout::Dedicated, 0) => (&mut alone, &pool),
            (Layout::Dedicated, _) => (&mut group, &others_pool),
            _ => (&mut group, &pool),
        };
        target.add(
            PgStore::new(pool.clone(), tables.clone()),
            publisher,
            RelayConfig::default(),
        );
    }
    let committed: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
    let producers = PgPoolOptions::new().max_connections(8).connect(url).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    // When the backlog was there, and when it was drained.
    let mut backlog_from = (arrival == Arrival::AtStart).then_some(started);
    let mut backlog_drained = None;
    let drive = async {
        let small: Vec<Outbox> = all[1..].iter().cloned().map(Outbox::new).collect();
        let period = Duration::from_secs_f64(1.0 / (args.rate.max(1) * small.len() as u64) as f64);
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut tasks = tokio::task::JoinSet::new();
        let mut backlog = None;
        let mut i = 0u64;
        // Offer live events until the backlog is drained.
        loop {
            if arrival == Arrival::WhileRunning
                && backlog.is_none()
                && backlog_from.is_none()
                && started.elapsed() >= SETTLE
            {
                let (url, tables) = (url.to_string(), all[0].clone());
                let n = args.backlog;
                backlog = Some(tokio::spawn(async move {
                    commit_backlog(&url, &tables, n)
                        .await
                        .map_err(|e| e.to_string())
                }));
            }
            if let Some(task) = backlog.take_if(|t| t.is_finished()) {
                backlog_from = Some(task.await??);
            }
            if backlog_from.is_some() && backlog_stamps.count() >= args.backlog as usize {
                backlog_drained = Some(Instant::now());
                break;
            }
            if started.elapsed() > limit {
                return Err::<(), Box<dyn std::error::Error + Send + Sync>>(
                    "the backlog did not drain in time".into(),
                );
            }
            ticks.tick().await;
            let outbox = small[(i as usize) % small.len()].clone();
            let (pool, committed) = (producers.clone(), Arc::clone(&committed));
            let event = event_of(1_000_000_000 + i, i % 100);
            i += 1;
            tasks.spawn(async move {
                let mut tx = pool.begin().await?;
                let id = outbox.enqueue(&mut tx, &event).await?;
                // The latency clock starts just before COMMIT is sent.
                let stamped = Instant::now();
                tx.commit().await?;
                if let Ok(mut c) = committed.lock() {
                    c.push((id, stamped));
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            });
            while let Some(done) = tasks.try_join_next() {
                done??;
            }
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        // The last live events.
        let expected = committed.lock().map(|c| c.len()).unwrap_or(0);
        stamping.wait_for(expected, Duration::from_secs(30)).await?;
        let _ = stop.send(true);
        Ok(())
    };
    let until_stopped = || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let relays = async {
        if layout == Layout::SeparateProbes {
            let separate: Vec<_> = group
                .relays()
                .iter()
                .map(|r| {
                    let store = r.store().clone().with_wakeup(Wakeup::adaptive());
                    Relay::new(store, Arc::clone(r.publisher())).with_config(RelayConfig::default())
                })
                .collect();
            futures_util::future::join_all(separate.iter().map(|relay| relay.run(until_stopped())))
                .await;
        } else {
            tokio::join!(group.run(until_stopped()), alone.run(until_stopped()));
        }
    };
    let (driven, ()) = tokio::join!(drive, relays);
    driven?;
    let (from, to) = backlog_from
        .zip(backlog_drained)
        .ok_or("the backlog's end was not seen")?;
    let committed = committed.lock().map(|c| c.clone()).unwrap_or_default();
    let published = stamping.published();
    // Every live event must have been published; measured: those committed while
    // the backlog drained.
    commit_to_publish_millis(&committed, &published)?;
    let during = |from: Instant, to: Instant| -> Result<Vec<f64>> {
        let window: Vec<(Uuid, Instant)> = committed
            .iter()
            .filter(|(_, at)| *at >= from && *at < to)
            .copied()
            .collect();
        commit_to_publish_millis(&window, &published)
    };
    let millis = during(from, to)?;
    let half = Duration::from_millis(500);
    let by_half_second = (0..WINDOWS)
        .map(|w| {
            Ok(percentile(
                &during(started + half * w, started + half * (w + 1))?,
                0.99,
            ))
        })
        .collect::<Result<Vec<f64>>>()?;
    producers.close().await;
    pool.close().await;
    others_pool.close().await;
    Ok(Phase {
        big_rate: args.backlog as f64 / (to - from).as_secs_f64(),
        millis,
        by_half_second,
    })
}

/// `[a, b, ...]` in whole milliseconds.
fn halves(p99s: &[f64]) -> String {
    p99s.iter()
        .map(|ms| format!("{ms:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) async fn group(url: &str, args: &GroupArgs) -> Result<Report> {
    let tenants = args.tenants.max(2);
    let admin = PgPoolOptions::new().max_connections(4).connect(url).await?;
    let budget = args.connections.max(2);
    let options = sqlx::postgres::PgConnectOptions::from_str(url)?
        .statement_cache_capacity(args.statement_cache);
    let relay_pool = || -> Result<PgPool> {
        Ok(PgPoolOptions::new()
            .max_connections(budget)
            .connect_lazy_with(options.clone()))
    };
    let all = fresh_tenants(&admin, tenants).await?;
    let limit = Duration::from_secs(60 + args.backlog / 1000);

    // The big tenant alone on the machine: one relay on a pool of the same budget.
    progress(format!("tenant 0 alone: {} events", args.backlog));
    fill(url, &admin, &all[0], args.backlog).await?;
    let alone = Stamping::default();
    let store = PgStore::new(relay_pool()?, all[0].clone());
    let relay = Relay::new(store, alone.clone()).with_config(RelayConfig::default());
    let took = run_while(&relay, alone.wait_for(args.backlog as usize, limit)).await;
    let idle_rate = args.backlog as f64 / took?.as_secs_f64();
    progress(format!("alone on the machine: {idle_rate:.0} events/s"));

    let traffic = format!("{} tenants at {} events/s", tenants - 1, args.rate);
    let arrival = if args.at_start {
        Arrival::AtStart
    } else {
        Arrival::WhileRunning
    };
    let shape = match arrival {
        Arrival::AtStart => "waiting when the relays start".to_string(),
        Arrival::WhileRunning => format!(
            "committed at once after the relays ran {} s with the live traffic",
            SETTLE.as_secs()
        ),
    };
    progress(format!(
        "dedicated relay for tenant 0, the others grouped on another pool: {} events {shape}, {traffic}",
        args.backlog
    ));
    let dedicated = phase(
        url,
        &admin,
        &all,
        args,
        (Layout::Dedicated, arrival),
        &relay_pool,
    )
    .await?;
    progress(format!(
        "dedicated under the same traffic: {:.0} events/s",
        dedicated.big_rate
    ));
    let layout = if args.separate_probes {
        Layout::SeparateProbes
    } else {
        Layout::Group
    };
    progress(format!(
        "{layout:?} of {tenants} on {budget} connections: tenant 0 with {} events {shape}, {traffic}",
        args.backlog
    ));
    let shared = phase(url, &admin, &all, args, (layout, arrival), &relay_pool).await?;
    for tables in &all {
        sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            tables.schema().quoted()
        ))
        .execute(&admin)
        .await?;
    }

    let p = |millis: &[f64], q: f64| percentile(millis, q);
    let max = shared.millis.last().copied().unwrap_or(0.0);
    let ratio = shared.big_rate / dedicated.big_rate;
    let idle_ratio = shared.big_rate / idle_rate;
    let (p50, p99) = (p(&shared.millis, 0.50), p(&shared.millis, 0.99));
    let dedicated_p99 = p(&dedicated.millis, 0.99);
    Ok(Report {
        line: format!(
            "group{}: {tenants} tenants on {budget} connections; tenant 0's {} events ({shape}) drained at \
             {:.0}/s against {:.0}/s on a dedicated relay under the same traffic ({ratio:.2}; target >= 0.7: {}) \
             and {idle_rate:.0}/s alone on the machine ({idle_ratio:.2}); {} live events of {traffic} \
             committed while it drained: commit-to-publish p50 {p50:.2} ms, p99 {p99:.2} ms \
             (target <= 50: {}), max {max:.1} ms; with the dedicated relay: p99 {dedicated_p99:.2} ms; \
             p99 of the live events by half second from the relays' start: group [{}], dedicated [{}]",
            if args.separate_probes {
                " (separate probes)"
            } else {
                ""
            },
            args.backlog,
            shared.big_rate,
            dedicated.big_rate,
            verdict(ratio >= 0.7),
            shared.millis.len(),
            verdict(p99 <= 50.0),
            halves(&shared.by_half_second),
            halves(&dedicated.by_half_second),
        ),
        json: json!({
            "scenario": "group", "separate_probes": args.separate_probes, "tenants": tenants, "connections": budget,
            "backlog": args.backlog, "backlog_at_start": args.at_start, "rate_per_tenant": args.rate,
            "statement_cache": args.statement_cache,
            "backlog_per_s": shared.big_rate, "dedicated_per_s": dedicated.big_rate, "ratio": ratio,
            "alone_per_s": idle_rate, "ratio_to_alone": idle_ratio,
            "live_events_while_draining": shared.millis.len(),
            "latency_ms": {"p50": p50, "p99": p99, "max": max},
            "dedicated_latency_ms": {"p99": dedicated_p99},
            "p99_ms_by_half_second": {"group": shared.by_half_second, "dedicated": dedicated.by_half_second},
        }),
    })
}
