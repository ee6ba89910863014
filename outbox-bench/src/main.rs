//! Benchmarks of the outbox on a real PostgreSQL: see `BENCHMARKS.md` at the
//! repository root for the machine, the commands and the figures.
//!
//! `cargo run --release -p outbox-bench -- <scenario> [options]`; each scenario
//! prints one result line (and a JSON object with `--json`).

mod adopt;
mod db;
mod drain;
mod group;
mod horizon;
mod latency;
mod live;
mod machine;
mod produce;
mod report;
mod resources;
mod shapes;
mod stats;
mod wal;

use clap::{Parser, Subcommand};

/// Errors end the run with a message.
pub(crate) type Result<T, E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

#[derive(Parser, Debug)]
#[command(about = "Benchmarks of the outbox against PostgreSQL")]
struct Cli {
    /// PostgreSQL URL; the benchmark uses (and drops) the schema `outbox_bench`.
    #[arg(
        long,
        global = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// Also print the result as one JSON object.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    scenario: Scenario,
}

/// Wake-up modes of the relay, as named on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Sleep `poll_interval` (100 ms) after an empty claim.
    Fixed,
    /// Adaptive polling (the default): 1 ms after activity, backing off to 100 ms.
    Adaptive,
    /// LISTEN/NOTIFY with the statement trigger installed.
    Notify,
}

impl Mode {
    pub(crate) fn wakeup(self) -> pgoutbox_postgres::Wakeup {
        match self {
            Mode::Fixed => pgoutbox_postgres::Wakeup::FixedPoll,
            Mode::Adaptive => pgoutbox_postgres::Wakeup::adaptive(),
            Mode::Notify => pgoutbox_postgres::Wakeup::notify(),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Fixed => "fixed-poll",
            Mode::Adaptive => "adaptive-poll",
            Mode::Notify => "notify",
        }
    }
}

#[derive(Subcommand, Debug)]
enum Scenario {
    /// Drain a backlog with K relays and a null publisher; compare with the same SQL
    /// work done without the relay.
    Drain(drain::DrainArgs),
    /// Drain a backlog into a broker (NATS JetStream, Kafka, RabbitMQ, SQS; each
    /// needs its feature); compare with the null publisher, or with
    /// `--aggregate-counts` the same backlog over several numbers of aggregates.
    DrainBroker(drain::BrokerArgs),
    /// Concurrent producer transactions with and without an outbox event, per wake-up mode.
    Produce(produce::ProduceArgs),
    /// Commit-to-publish latency at a fixed offered rate, per wake-up mode.
    Latency(latency::LatencyArgs),
    /// Drain rate on an empty table against one with many processed rows kept.
    History(drain::HistoryArgs),
    /// Peak resident memory of a relay process draining a large backlog.
    Rss(resources::RssArgs),
    /// What an idle (or nearly idle) relay costs, per wake-up mode.
    Idle(resources::IdleArgs),
    /// Ordered drain per key distribution (1 to 10,000 aggregates, Zipf) against the
    /// unordered rate.
    Shapes(shapes::ShapesArgs),
    /// Ordered drain of a large backlog against a small one (10 aggregates).
    Backlog(shapes::BacklogArgs),
    /// Ordered drain with 4 relays against 1, per table-statistics state.
    Scaling(shapes::ScalingArgs),
    /// Ordered drain while 20,000 other aggregates are held, against none held.
    Held(shapes::HeldArgs),
    /// Live traffic and a drain through the `outbox` binary while another session
    /// holds a snapshot the whole time, against the same without the hold.
    Horizon(horizon::HorizonArgs),
    /// Live traffic through `outbox relay` processes into NATS JetStream, from an
    /// emptied and analysed table (needs the `nats` feature).
    Live(live::LiveArgs),
    /// WAL mode against table mode: producer throughput, latency, drain.
    Wal(wal::WalArgs),
    /// Fairness of a relay group: one tenant's large backlog against many small
    /// tenants' live traffic, on one pool.
    Group(group::GroupArgs),
    /// Adopt a seed-layout outbox of a million rows while producers write: how long
    /// their INSERTs wait.
    Adopt(adopt::AdoptArgs),
    /// Every headline scenario, alternated over rounds, as one table (see
    /// BENCHMARKS.md); builds nothing: runs this binary and the `outbox` binary.
    Report(report::ReportArgs),
    /// Internal: the relay process measured by `rss`.
    #[command(hide = true)]
    RssChild(resources::RssChildArgs),
}

/// One scenario's result: a line for people, a JSON object for scripts.
pub(crate) struct Report {
    pub(crate) line: String,
    pub(crate) json: serde_json::Value,
}

fn main() {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("outbox-bench: cannot start the runtime: {error}");
            std::process::exit(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => {}
        Err(error) => {
            eprintln!("outbox-bench: {error}");
            std::process::exit(1);
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let url = cli.database_url.as_str();
    let machine = machine::MachineAtStart::now();
    let mut report = match cli.scenario {
        Scenario::Drain(args) => drain::drain(url, &args).await?,
        Scenario::DrainBroker(args) => drain::drain_broker(url, &args).await?,
        Scenario::Produce(args) => produce::produce(url, &args).await?,
        Scenario::Latency(args) => latency::latency(url, &args).await?,
        Scenario::History(args) => drain::history(url, &args).await?,
        Scenario::Rss(args) => resources::rss(url, &args).await?,
        Scenario::Idle(args) => resources::idle(url, &args).await?,
        Scenario::Shapes(args) => shapes::shapes(url, &args).await?,
        Scenario::Wal(args) => wal::wal(url, &args).await?,
        Scenario::Group(args) => group::group(url, &args).await?,
        Scenario::Backlog(args) => shapes::backlog_size(url, &args).await?,
        Scenario::Scaling(args) => shapes::scaling(url, &args).await?,
        Scenario::Held(args) => shapes::held(url, &args).await?,
        Scenario::Horizon(args) => horizon::horizon(url, &args).await?,
        Scenario::Live(args) => live::live(url, &args).await?,
        Scenario::Adopt(args) => adopt::adopt(url, &args).await?,
        Scenario::Report(args) => report::report(url, &args).await?,
        Scenario::RssChild(args) => return resources::rss_child(url, &args).await,
    };
    let (text, json) = machine.since();
    report.line.push_str(&text);
    if let Some(object) = report.json.as_object_mut() {
        object.insert("machine".into(), json);
    }
    println!("{}", report.line);
    if cli.json {
        println!("{}", report.json);
    }
    Ok(())
}

/// `met` or `NOT met`, for result lines.
pub(crate) fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT met"
    }
}

/// The order of a round's two sides: the first side first in even rounds, second
/// in odd ones, so that neither side always has the warmer (or the tireder) machine.
pub(crate) fn sides(round: usize) -> [bool; 2] {
    [round.is_multiple_of(2), !round.is_multiple_of(2)]
}

/// Progress on standard error, so result lines stay alone on standard output.
pub(crate) fn progress(message: impl std::fmt::Display) {
    eprintln!("  .. {message}");
}
