//! Claim cost against the shape of the backlog: how events spread over aggregates,
//! how many are pending, what the table statistics say, how many relays claim.
//! Every drain here uses the null publisher, so the figures are the store's.

use clap::Args;
use pgoutbox_core::{Claim, NullPublisher, RelayConfig, Store};
use pgoutbox_postgres::{PgStore, Retention, StoreConfig};
use serde_json::json;

use crate::db::{run_relays, Bench, Keys};
use crate::stats::{median, ratios_per_round};
use crate::{progress, verdict, Report, Result};

/// The statistics PostgreSQL has of the events table when a drain starts.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stats {
    /// Never analysed (a new table; autovacuum has not run yet).
    Never,
    /// Analysed while empty, then filled (a delete-on-publish queue that
    /// autovacuum analysed between bursts).
    Empty,
    /// Filled, then analysed.
    Full,
}

impl Stats {
    fn name(self) -> &'static str {
        match self {
            Stats::Never => "never analysed",
            Stats::Empty => "analysed while empty",
            Stats::Full => "analysed while full",
        }
    }
}

/// A fresh outbox holding `n` events spread by `keys`, with statistics `stats`.
async fn backlog(url: &str, n: u64, keys: &Keys, stats: Stats) -> Result<Bench> {
    let bench = Bench::fresh(url).await?;
    match stats {
        Stats::Never => bench.fill_keys(n, keys).await?,
        Stats::Empty => {
            bench.analyze().await?;
            bench.fill_keys(n, keys).await?;
        }
        Stats::Full => {
            bench.fill_keys(n, keys).await?;
            bench.analyze().await?;
        }
    }
    bench.checkpoint().await?;
    Ok(bench)
}

/// The store `relays` relays drain with: one connection each and one spare.
async fn drain_store(bench: &Bench, relays: usize, ordering: bool) -> Result<PgStore> {
    Ok(bench.store(relays as u32 + 1).await?.with_config(
        StoreConfig::default()
            .ordering(ordering)
            .retention(Retention::Delete),
    ))
}

/// Drain the whole backlog with `relays` relays (null publisher); events per second.
async fn drain_rate(bench: &Bench, n: u64, relays: usize, ordering: bool) -> Result<f64> {
    let store = drain_store(bench, relays, ordering).await?;
    drain_with(&store, n, relays).await
}

/// Drain `n` events through `store`, then close its pool; events per second.
async fn drain_with(store: &PgStore, n: u64, relays: usize) -> Result<f64> {
    let elapsed = run_relays(store, NullPublisher, relays, &RelayConfig::default(), n).await?;
    store.pool().close().await;
    Ok(n as f64 / elapsed.as_secs_f64())
}

#[derive(Args, Debug)]
pub(crate) struct ShapesArgs {
    /// Events per backlog.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Table statistics before each drain.
    #[arg(long, value_enum, default_value_t = Stats::Full)]
    stats: Stats,
    /// Rounds; each drains every shape ordered and unordered, the two in turn
    /// first; figures are medians and ratios per round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// One key distribution's ordered and unordered drain rates, one of each per round.
struct ShapeRates {
    name: String,
    ordered: Vec<f64>,
    unordered: Vec<f64>,
}

impl ShapeRates {
    /// The median of the ratios per round.
    fn ratio(&self) -> f64 {
        median(&ratios_per_round(&self.ordered, &self.unordered))
    }
}

/// Ordered drain rate per key distribution against the unordered rate of the same
/// backlog, in one run.
pub(crate) async fn shapes(url: &str, args: &ShapesArgs) -> Result<Report> {
    let n = args.events;
    let zipf = Keys::Zipf {
        s: 1.1,
        keys: 10_000,
    };
    let hottest = {
        let mut counts = std::collections::HashMap::new();
        for k in zipf.draw(n) {
            *counts.entry(k).or_insert(0u64) += 1;
        }
        counts.values().copied().max().unwrap_or(0)
    };
    let shapes = [
        Keys::Uniform(1),
        Keys::Uniform(10),
        Keys::Uniform(100),
        Keys::Uniform(10_000),
        zipf,
    ];
    let mut rates: Vec<ShapeRates> = shapes
        .iter()
        .map(|keys| ShapeRates {
            name: keys.describe(),
            ordered: Vec::new(),
            unordered: Vec::new(),
        })
        .collect();
    for round in 0..args.rounds.max(1) {
        for (keys, shape) in shapes.iter().zip(rates.iter_mut()) {
            for ordering in crate::sides(round) {
                let bench = backlog(url, n, keys, args.stats).await?;
                let rate = drain_rate(&bench, n, 1, ordering).await?;
                let mode = if ordering { "ordered" } else { "unordered" };
                progress(format!(
                    "round {}, {}, {mode}: {rate:.0} events/s",
                    round + 1,
                    shape.name
                ));
                if ordering {
                    shape.ordered.push(rate);
                } else {
                    shape.unordered.push(rate);
                }
            }
        }
    }
    let worst = rates
        .iter()
        .map(ShapeRates::ratio)
        .fold(f64::INFINITY, f64::min);
    let parts: Vec<String> = rates
        .iter()
        .map(|r| {
            format!(
                "{} {:.0} vs {:.0} ({:.2})",
                r.name,
                median(&r.ordered),
                median(&r.unordered),
                r.ratio()
            )
        })
        .collect();
    Ok(Report {
        line: format!(
            "shapes: ordered vs unordered drain of the same backlog, events/s, medians of {} \
             rounds: {}; worst median ratio {worst:.2} (target >= 0.8: {}) \
             [events={n} per backlog, 1 relay, null publisher, {}; zipf hottest key {hottest} events]",
            args.rounds.max(1),
            parts.join(", "),
            verdict(worst >= 0.8),
            args.stats.name(),
        ),
        json: json!({
            "scenario": "shapes", "events": n, "stats": args.stats.name(),
            "rounds": args.rounds.max(1),
            "shapes": rates.iter().map(|r| json!({
                "keys": r.name, "ordered_events_per_s": median(&r.ordered),
                "unordered_events_per_s": median(&r.unordered), "ratio": r.ratio(),
                "ordered_rounds": r.ordered, "unordered_rounds": r.unordered,
            })).collect::<Vec<_>>(),
            "zipf_hottest_key_events": hottest,
            "worst_ratio": worst, "target_met": worst >= 0.8,
        }),
    })
}

#[derive(Args, Debug)]
pub(crate) struct BacklogArgs {
    /// Events in the large backlog.
    #[arg(long, default_value_t = 1_000_000)]
    large: u64,
    /// Events in the small backlog.
    #[arg(long, default_value_t = 10_000)]
    small: u64,
    /// Aggregates the events belong to.
    #[arg(long, default_value_t = 10)]
    aggregates: u64,
    /// Rounds; each drains both backlogs, the two in turn first.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// Ordered drain rate of a large backlog against a small one: a claim's cost must
/// not grow with what is pending behind it.
pub(crate) async fn backlog_size(url: &str, args: &BacklogArgs) -> Result<Report> {
    let keys = Keys::Uniform(args.aggregates);
    let (mut larges, mut smalls) = (Vec::new(), Vec::new());
    for round in 0..args.rounds.max(1) {
        for large_side in crate::sides(round) {
            let n = if large_side { args.large } else { args.small };
            let bench = backlog(url, n, &keys, Stats::Full).await?;
            let rate = drain_rate(&bench, n, 1, true).await?;
            progress(format!(
                "round {}, {n} events: {rate:.0} events/s",
                round + 1
            ));
            if large_side {
                larges.push(rate);
            } else {
                smalls.push(rate);
            }
        }
    }
    let ratios = ratios_per_round(&larges, &smalls);
    let (large, small, ratio) = (median(&larges), median(&smalls), median(&ratios));
    Ok(Report {
        line: format!(
            "backlog: ordered drain of {} events {large:.0} events/s vs {} events \
             {small:.0} events/s (medians), median ratio per round {ratio:.2} (target >= 0.9: {}) \
             [{} aggregates, 1 relay, null publisher, analysed while full]",
            args.large,
            args.small,
            verdict(ratio >= 0.9),
            args.aggregates
        ),
        json: json!({
            "scenario": "backlog", "aggregates": args.aggregates,
            "large": args.large, "small": args.small,
            "large_events_per_s": large, "small_events_per_s": small,
            "large_rounds": larges, "small_rounds": smalls, "ratio_rounds": ratios,
            "ratio": ratio, "target_met": ratio >= 0.9,
        }),
    })
}

#[derive(Args, Debug)]
pub(crate) struct ScalingArgs {
    /// Backlog size.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Aggregates the events belong to.
    #[arg(long, default_value_t = 2_000)]
    aggregates: u64,
    /// Relays of the second drain (the first has one).
    #[arg(long, default_value_t = 4)]
    relays: usize,
    /// Rounds; each drains with one relay and with `relays`, the two in turn
    /// first; figures are medians and ratios per round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// Ordered drain with several relays against one, in each statistics state.
pub(crate) async fn scaling(url: &str, args: &ScalingArgs) -> Result<Report> {
    let keys = Keys::Uniform(args.aggregates);
    let n = args.events;
    let mut results = Vec::new();
    let rounds = args.rounds.max(1);
    for stats in [Stats::Never, Stats::Empty, Stats::Full] {
        let (mut ones, mut manys) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            for single in crate::sides(round) {
                let relays = if single { 1 } else { args.relays };
                let bench = backlog(url, n, &keys, stats).await?;
                let rate = drain_rate(&bench, n, relays, true).await?;
                if single {
                    ones.push(rate);
                } else {
                    manys.push(rate);
                }
            }
        }
        progress(format!(
            "{}: 1 relay {:.0}, {} relays {:.0} events/s (medians)",
            stats.name(),
            median(&ones),
            args.relays,
            median(&manys)
        ));
        results.push((stats, ones, manys));
    }
    let ratio = |ones: &[f64], manys: &[f64]| median(&ratios_per_round(manys, ones));
    let worst = results
        .iter()
        .map(|(_, ones, manys)| ratio(ones, manys))
        .fold(f64::INFINITY, f64::min);
    let parts: Vec<String> = results
        .iter()
        .map(|(stats, ones, manys)| {
            format!(
                "{}: 1 relay {:.0}, {} relays {:.0} ({:.2})",
                stats.name(),
                median(ones),
                args.relays,
                median(manys),
                ratio(ones, manys)
            )
        })
        .collect();
    Ok(Report {
        line: format!(
            "scaling: ordered drain, events/s, medians of {rounds} rounds: {}; worst median ratio {worst:.2} \
             (target >= 0.8: {}) [events={n} over {} aggregates, null publisher]",
            parts.join("; "),
            verdict(worst >= 0.8),
            args.aggregates
        ),
        json: json!({
            "scenario": "scaling", "events": n, "aggregates": args.aggregates,
            "relays": args.relays, "rounds": rounds,
            "states": results.iter().map(|(stats, ones, manys)| json!({
                "stats": stats.name(), "one_relay_events_per_s": median(ones),
                "relays_events_per_s": median(manys), "ratio": ratio(ones, manys),
                "one_relay_rounds": ones, "relays_rounds": manys,
            })).collect::<Vec<_>>(),
            "worst_ratio": worst, "target_met": worst >= 0.8,
        }),
    })
}

#[derive(Args, Debug)]
pub(crate) struct HeldArgs {
    /// Backlog size.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Aggregates the backlog's events belong to.
    #[arg(long, default_value_t = 10_000)]
    aggregates: u64,
    /// Other aggregates held, each until an hour from now (a hold row, as a failed
    /// event leaves; their events are not in the backlog).
    #[arg(long, default_value_t = 20_000)]
    held: u64,
    /// Rounds; each drains with and without the holds, the two in turn first;
    /// figures are medians and ratios per round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// Ordered drain of a backlog while many other aggregates are held, against the
/// same drain with none held: what a long partial outage (a broker refusing some
/// events for a while) costs the aggregates that are fine. Events and holds tables
/// analysed while empty, as autovacuum leaves a drained queue, and the relay's
/// statements planned before anything was held.
pub(crate) async fn held(url: &str, args: &HeldArgs) -> Result<Report> {
    let keys = Keys::Uniform(args.aggregates);
    let n = args.events;
    let rounds = args.rounds.max(1);
    let (mut frees, mut helds) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for none_held in crate::sides(round) {
            let bench = Bench::fresh(url).await?;
            sqlx::raw_sql(&format!(
                "ANALYZE {schema}.outbox_events; ANALYZE {schema}.outbox_events_held",
                schema = crate::db::SCHEMA
            ))
            .execute(&bench.pool)
            .await?;
            bench.fill_keys(n, &keys).await?;
            // The relay started while nothing was held: each of its connections
            // has planned the claim (a generic plan, cached) before the holds come.
            let store = drain_store(&bench, 1, true).await?;
            let mut claims = Vec::new();
            for _ in 0..2 {
                claims.push(store.claim(1).await?);
            }
            for claim in claims {
                claim.release().await?;
            }
            if !none_held {
                // Aggregates of another type: none of the backlog's.
                sqlx::query(&format!(
                    "INSERT INTO {}.outbox_events_held (aggregate_type, aggregate_id, until) \
                     SELECT 'held', 'held-' || i, now() + interval '1 hour' \
                     FROM generate_series(1, $1) AS i",
                    crate::db::SCHEMA
                ))
                .bind(i64::try_from(args.held).unwrap_or(i64::MAX))
                .execute(&bench.pool)
                .await?;
            }
            bench.checkpoint().await?;
            let rate = drain_with(&store, n, 1).await?;
            let holds = if none_held { 0 } else { args.held };
            progress(format!(
                "round {}, {holds} held: {rate:.0} events/s",
                round + 1
            ));
            if none_held {
                frees.push(rate);
            } else {
                helds.push(rate);
            }
        }
    }
    let ratios = ratios_per_round(&helds, &frees);
    let (free, with_holds, ratio) = (median(&frees), median(&helds), median(&ratios));
    Ok(Report {
        line: format!(
            "held: ordered drain with {} other aggregates held {with_holds:.0} events/s vs \
             none held {free:.0} events/s, medians of {rounds} rounds, median ratio per round {ratio:.2} \
             (target >= 0.9: {}) [events={n} over {} aggregates, 1 relay, null publisher, \
             events and holds analysed while empty]",
            args.held,
            verdict(ratio >= 0.9),
            args.aggregates
        ),
        json: json!({
            "scenario": "held", "events": n, "aggregates": args.aggregates,
            "held": args.held, "rounds": rounds,
            "held_events_per_s": with_holds, "none_held_events_per_s": free,
            "held_rounds": helds, "none_held_rounds": frees, "ratio_rounds": ratios,
            "ratio": ratio, "target_met": ratio >= 0.9,
        }),
    })
}
