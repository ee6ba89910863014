//! Drain scenarios: relay against the SQL limit, against a broker, and as history grows.

use std::time::Duration;

use clap::Args;
use pgoutbox_core::{NullPublisher, Publisher, RelayConfig};
use pgoutbox_postgres::{PgStore, Retention, StoreConfig};
use serde_json::json;

use crate::db::{run_relays, run_sql_limit, Bench};
use crate::stats::{median, ratios_per_round};
use crate::{progress, verdict, Report, Result};

/// Options shared by the drain scenarios.
#[derive(Args, Debug, Clone)]
pub(crate) struct DrainOptions {
    /// Backlog size.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// Relays draining concurrently (and SQL loops for the limit).
    #[arg(long, default_value_t = 1)]
    relays: usize,
    /// Events per claim (`RelayConfig::batch_size`); default: the relay's default.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Distinct aggregates the events belong to.
    #[arg(long, default_value_t = 10_000)]
    aggregates: u64,
    /// Claim without per-aggregate ordering.
    #[arg(long)]
    unordered: bool,
    /// Whether the relay's record commits (and the SQL limit's) wait for the WAL
    /// flush: `true`, the store's default, unless `--synchronous-commit false`.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    synchronous_commit: bool,
    /// Rounds; each measures both sides back to back, the first side alternating
    /// from round to round. Figures: the median and the ratio per round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

impl DrainOptions {
    fn relay_config(&self) -> RelayConfig {
        let mut config = RelayConfig::default();
        if let Some(batch) = self.batch_size {
            config.batch_size = batch;
        }
        config
    }

    fn store_config(&self, retention: Retention) -> StoreConfig {
        StoreConfig::default()
            .ordering(!self.unordered)
            .retention(retention)
            .synchronous_commit(self.synchronous_commit)
    }

    /// The benchmark schema, fresh, and a store for `relays` relays of `workers`
    /// claim loops each (one connection per loop, one more for the benchmark).
    async fn start(&self, url: &str, workers: usize, retention: Retention) -> Result<Drains> {
        let bench = Bench::fresh(url).await?;
        let relays = self.relays.max(1);
        let store = bench
            .store((relays * workers) as u32 + 1)
            .await?
            .with_config(self.store_config(retention));
        Ok(Drains {
            bench,
            config: self.relay_config(),
            relays,
            store,
            events: self.events,
        })
    }

    fn describe(&self, config: &RelayConfig) -> String {
        format!(
            "events={} relays={} batch={} aggregates={} ordering={} synchronous_commit={}",
            self.events,
            self.relays,
            config.batch_size,
            self.aggregates,
            !self.unordered,
            self.synchronous_commit
        )
    }
}

/// What a drain scenario runs its drains with.
struct Drains {
    bench: Bench,
    config: RelayConfig,
    relays: usize,
    store: PgStore,
    events: u64,
}

impl Drains {
    /// Events per second of the relays draining the backlog with `config`.
    async fn relay_rate<P: Publisher + Clone + 'static>(
        &self,
        publisher: P,
        config: &RelayConfig,
    ) -> Result<f64> {
        let elapsed = run_relays(&self.store, publisher, self.relays, config, self.events).await?;
        Ok(self.events as f64 / elapsed.as_secs_f64())
    }
}

#[derive(Args, Debug)]
pub(crate) struct DrainArgs {
    #[command(flatten)]
    options: DrainOptions,
}

/// Relay drain rate with the null publisher against the same SQL work without the
/// relay, on the same store settings, connections opened before each clock starts;
/// the SQL limit runs first in every other round.
pub(crate) async fn drain(url: &str, args: &DrainArgs) -> Result<Report> {
    let o = &args.options;
    let d = o.start(url, 1, Retention::Delete).await?;
    let (config, relays) = (&d.config, d.relays);

    let rounds = o.rounds.max(1);
    let (mut relay_rates, mut limit_rates) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for relay_side in crate::sides(round) {
            d.bench.backlog(o.events, o.aggregates).await?;
            if relay_side {
                let rate = d.relay_rate(NullPublisher, config).await?;
                progress(format!("round {}: relay {rate:.0} events/s", round + 1));
                relay_rates.push(rate);
            } else {
                let time =
                    run_sql_limit(url, &d.store, relays, config.batch_size, o.events).await?;
                let rate = o.events as f64 / time.as_secs_f64();
                progress(format!("round {}: SQL limit {rate:.0} events/s", round + 1));
                limit_rates.push(rate);
            }
        }
    }

    let ratios = ratios_per_round(&relay_rates, &limit_rates);
    let ratio = median(&ratios);
    let (relay_rate, limit_rate) = (median(&relay_rates), median(&limit_rates));
    Ok(Report {
        line: format!(
            "drain: relay {relay_rate:.0} events/s, SQL limit {limit_rate:.0} events/s \
             (medians), median ratio per round {ratio:.2} (target >= 0.8: {}) [{} rounds={rounds}]",
            verdict(ratio >= 0.8),
            o.describe(config),
        ),
        json: json!({
            "scenario": "drain", "events": o.events, "relays": relays,
            "batch_size": config.batch_size, "ordering": !o.unordered,
            "aggregates": o.aggregates, "synchronous_commit": o.synchronous_commit,
            "relay_events_per_s": relay_rate, "limit_events_per_s": limit_rate,
            "relay_rounds": relay_rates, "limit_rounds": limit_rates, "ratio_rounds": ratios,
            "ratio": ratio, "target_met": ratio >= 0.8,
        }),
    })
}

/// The broker `drain-broker` publishes to.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Broker {
    /// NATS JetStream (needs the `nats` feature).
    Nats,
    /// Kafka, e.g. tansu from `scripts/tansu.sh` (needs the `kafka` feature).
    Kafka,
    /// RabbitMQ (needs the `amqp` feature).
    Amqp,
    /// SQS, e.g. moto from `scripts/moto.sh`: a FIFO queue (needs the `sqs` feature).
    Sqs,
}

#[derive(Args, Debug)]
pub(crate) struct BrokerArgs {
    #[command(flatten)]
    options: DrainOptions,
    /// Claim loops per relay (`RelayConfig::workers`) for the broker run.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// The broker to drain into.
    #[arg(long, value_enum, default_value_t = Broker::Nats)]
    broker: Broker,
    /// NATS server.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Kafka bootstrap servers (`scripts/tansu.sh` starts tansu on 127.0.0.1:19092).
    #[arg(long, default_value = "127.0.0.1:19092")]
    kafka_brokers: String,
    /// A librdkafka property of the Kafka producer, `key=value` (repeatable), laid
    /// over the publisher's own settings, e.g. `linger.ms=5`.
    #[arg(long = "kafka-set", value_parser = key_value)]
    kafka_set: Vec<(String, String)>,
    /// RabbitMQ server.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp_url: String,
    /// SQS endpoint (`scripts/moto.sh` exports moto's as `OUTBOX_SQS_ENDPOINT`).
    #[arg(
        long,
        env = "OUTBOX_SQS_ENDPOINT",
        default_value = "http://127.0.0.1:5000"
    )]
    sqs_endpoint: String,
    /// Instead of comparing with the null publisher, drain the backlog once per
    /// number of aggregates in this list (e.g. `1,10,10000`) into the broker, and
    /// compare the first rate with the last.
    #[arg(long, value_delimiter = ',')]
    aggregate_counts: Vec<u64>,
    /// With `--aggregate-counts`: also drain the last count's backlog into the
    /// null publisher, after the broker drains (what the relay does without a broker).
    #[arg(long)]
    with_null: bool,
}

fn key_value(text: &str) -> std::result::Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => {
            Ok((key.trim().to_string(), value.trim().to_string()))
        }
        _ => Err(format!("`{text}`: expected key=value")),
    }
}

/// Drain into a broker against the null publisher.
pub(crate) async fn drain_broker(url: &str, args: &BrokerArgs) -> Result<Report> {
    if args.broker != Broker::Kafka && !args.kafka_set.is_empty() {
        return Err("drain-broker: --kafka-set applies to --broker kafka only".into());
    }
    let o = &args.options;
    let d = o.start(url, args.workers.max(1), Retention::Delete).await?;
    let (config, relays) = (&d.config, d.relays);

    let broker_config = config.clone().workers(args.workers.max(1));
    if !args.aggregate_counts.is_empty() {
        return per_aggregate_count(&d, args, &broker_config).await;
    }
    // The broker first: a binary built without its feature stops here.
    d.bench.backlog(o.events, o.aggregates).await?;
    let (broker, broker_rate) = broker_rate(&d, args, &broker_config).await?;

    d.bench.backlog(o.events, o.aggregates).await?;
    progress("relay draining into the null publisher");
    let null_rate = d.relay_rate(NullPublisher, config).await?;

    let ratio = broker_rate / null_rate;
    let properties: Vec<String> = args
        .kafka_set
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect();
    let extra = if properties.is_empty() {
        String::new()
    } else {
        format!(" kafka: {}", properties.join(","))
    };
    Ok(Report {
        line: format!(
            "drain-broker: {broker} {broker_rate:.0} events/s, null publisher \
             {null_rate:.0} events/s, ratio {ratio:.2} [{} workers={}{extra}]",
            o.describe(config),
            args.workers
        ),
        json: {
            let mut json = json!({
                "scenario": "drain-broker", "broker": broker, "events": o.events,
                "relays": relays, "workers": args.workers, "batch_size": config.batch_size,
                "aggregates": o.aggregates, "ordering": !o.unordered,
                "broker_events_per_s": broker_rate, "null_events_per_s": null_rate,
                "ratio": ratio,
            });
            if args.broker == Broker::Kafka {
                json["kafka_properties"] = json!(properties);
            }
            json
        },
    })
}

/// Drain rate of the backlog in place into the chosen broker, and its name.
async fn broker_rate(
    d: &Drains,
    args: &BrokerArgs,
    config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    match args.broker {
        Broker::Nats => nats_rate(d, args, config).await,
        Broker::Kafka => kafka_rate(d, args, config).await,
        Broker::Amqp => amqp_rate(d, args, config).await,
        Broker::Sqs => sqs_rate(d, args, config).await,
    }
}

/// `drain-broker --aggregate-counts`: the same number of events over each number of
/// aggregates, drained into the broker; the ratio of the first rate to the last
/// (with `1,10,10000`: a hot aggregate against many).
async fn per_aggregate_count(
    d: &Drains,
    args: &BrokerArgs,
    config: &RelayConfig,
) -> Result<Report> {
    let o = &args.options;
    let mut rates = Vec::with_capacity(args.aggregate_counts.len());
    let mut name = "";
    for &aggregates in &args.aggregate_counts {
        d.bench.backlog(o.events, aggregates).await?;
        progress(format!("{aggregates} aggregates"));
        let (broker, rate) = broker_rate(d, args, config).await?;
        progress(format!(
            "{aggregates} aggregates: {broker} {rate:.0} events/s"
        ));
        name = broker;
        rates.push((aggregates, rate));
    }
    let null_rate = match (args.with_null, args.aggregate_counts.last()) {
        (true, Some(&aggregates)) => {
            d.bench.backlog(o.events, aggregates).await?;
            progress(format!(
                "{aggregates} aggregates: relay draining into the null publisher"
            ));
            Some(d.relay_rate(NullPublisher, config).await?)
        }
        _ => None,
    };
    let first = rates.first().map_or(0.0, |r| r.1);
    let last = rates.last().map_or(0.0, |r| r.1);
    let ratio = if last > 0.0 { first / last } else { 0.0 };
    let figures: Vec<String> = rates
        .iter()
        .map(|(aggregates, rate)| format!("{aggregates} aggregates {rate:.0} events/s"))
        .collect();
    Ok(Report {
        line: format!(
            "drain-broker: {name} {}; first/last {ratio:.2} [events={} relays={} batch={} \
             workers={} ordering={}]",
            figures.join(", "),
            o.events,
            d.relays,
            config.batch_size,
            args.workers,
            !o.unordered
        ),
        json: json!({
            "scenario": "drain-broker", "broker": name, "events": o.events,
            "relays": d.relays, "workers": args.workers, "batch_size": config.batch_size,
            "ordering": !o.unordered,
            "rates": rates
                .iter()
                .map(|(aggregates, rate)| json!({"aggregates": aggregates, "events_per_s": rate}))
                .collect::<Vec<_>>(),
            "first_to_last": ratio, "null_events_per_s": null_rate,
        }),
    })
}

/// Drain rate into a fresh NATS JetStream stream.
#[cfg(feature = "nats")]
async fn nats_rate(
    d: &Drains,
    args: &BrokerArgs,
    config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    let stream = "OUTBOX_BENCH";
    let publisher = crate::db::fresh_stream(&args.nats_url, "outboxbench", stream).await?;
    progress("relay draining into NATS JetStream");
    let rate = d.relay_rate(publisher.clone(), config).await?;
    let _ = publisher.jetstream().delete_stream(stream).await;
    Ok(("NATS JetStream", rate))
}

#[cfg(not(feature = "nats"))]
async fn nats_rate(
    _d: &Drains,
    _args: &BrokerArgs,
    _config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    Err(built_without("nats"))
}

/// Drain rate into a new Kafka topic (8 partitions, keyed by aggregate id), deleted
/// after the drain.
#[cfg(feature = "kafka")]
async fn kafka_rate(
    d: &Drains,
    args: &BrokerArgs,
    config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    let topic = format!("outbox-bench-{}", uuid::Uuid::now_v7());
    let mut kafka = pgoutbox_kafka::KafkaConfig::new(&args.kafka_brokers).topic(&topic);
    for (key, value) in &args.kafka_set {
        kafka = kafka.set(key, value);
    }
    kafka
        .ensure_topic(&topic, 8, Duration::from_secs(30))
        .await?;
    let publisher = kafka.clone().build()?;
    progress(format!("relay draining into Kafka topic {topic}"));
    let rate = d.relay_rate(std::sync::Arc::new(publisher), config).await;
    // The run's topic goes, whatever the drain did: runs against a shared cluster
    // would otherwise leave one 8-partition topic each.
    if let Err(e) = kafka.delete_topic(&topic, Duration::from_secs(30)).await {
        progress(format!("{e}; delete it by hand"));
    }
    Ok(("Kafka", rate?))
}

#[cfg(not(feature = "kafka"))]
async fn kafka_rate(
    _d: &Drains,
    _args: &BrokerArgs,
    _config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    Err(built_without("kafka"))
}

/// Drain rate into a fresh RabbitMQ topic exchange with one durable queue bound to
/// every routing key; both deleted after the drain.
#[cfg(feature = "amqp")]
async fn amqp_rate(
    d: &Drains,
    args: &BrokerArgs,
    config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    use pgoutbox_amqp::lapin::options::{
        ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use pgoutbox_amqp::lapin::types::FieldTable;
    use pgoutbox_amqp::lapin::ExchangeKind;
    use pgoutbox_amqp::{AmqpConfig, AmqpRouting};

    let name = format!("outbox_bench_{}", uuid::Uuid::now_v7().simple());
    let publisher = AmqpConfig::new(&args.amqp_url)
        .routing(AmqpRouting::new(&name))
        .connect()
        .await?;
    publisher.declare_exchange(ExchangeKind::Topic).await?;
    let channel = publisher.channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(&name, durable, FieldTable::default())
        .await?;
    channel
        .queue_bind(
            &name,
            &name,
            "#",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    progress(format!("relay draining into RabbitMQ exchange {name}"));
    let rate = d.relay_rate(publisher.clone(), config).await;
    let _ = channel
        .queue_delete(&name, QueueDeleteOptions::default())
        .await;
    let _ = channel
        .exchange_delete(&name, ExchangeDeleteOptions::default())
        .await;
    Ok(("RabbitMQ", rate?))
}

#[cfg(not(feature = "amqp"))]
async fn amqp_rate(
    _d: &Drains,
    _args: &BrokerArgs,
    _config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    Err(built_without("amqp"))
}

/// Drain rate into a fresh SQS FIFO queue (message group = aggregate id), deleted
/// after the drain.
#[cfg(feature = "sqs")]
async fn sqs_rate(
    d: &Drains,
    args: &BrokerArgs,
    config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    use pgoutbox_sqs::aws_sdk_sqs::types::QueueAttributeName;
    use pgoutbox_sqs::SqsConfig;

    let name = format!("outbox-bench-{}.fifo", uuid::Uuid::now_v7().simple());
    let publisher = SqsConfig::new(&name)
        .endpoint(&args.sqs_endpoint)
        .region("us-east-1")
        .credentials("test", "test")
        .build()
        .await?;
    let created = publisher
        .client()
        .create_queue()
        .queue_name(&name)
        .attributes(QueueAttributeName::FifoQueue, "true")
        .send()
        .await?;
    progress(format!("relay draining into SQS FIFO queue {name}"));
    let publisher = std::sync::Arc::new(publisher);
    let rate = d
        .relay_rate(std::sync::Arc::clone(&publisher), config)
        .await;
    if let Some(url) = created.queue_url() {
        let _ = publisher
            .client()
            .delete_queue()
            .queue_url(url)
            .send()
            .await;
    }
    Ok(("SQS", rate?))
}

#[cfg(not(feature = "sqs"))]
async fn sqs_rate(
    _d: &Drains,
    _args: &BrokerArgs,
    _config: &RelayConfig,
) -> Result<(&'static str, f64)> {
    Err(built_without("sqs"))
}

/// The error of `drain-broker --broker <name>` in a binary built without the
/// broker's feature (named like the broker).
#[cfg(any(
    not(feature = "nats"),
    not(feature = "kafka"),
    not(feature = "amqp"),
    not(feature = "sqs")
))]
fn built_without(name: &str) -> Box<dyn std::error::Error + Send + Sync> {
    format!("drain-broker --broker {name}: built without the `{name}` feature (build with `--features {name}`)").into()
}

#[derive(Args, Debug)]
pub(crate) struct HistoryArgs {
    #[command(flatten)]
    options: DrainOptions,
    /// Processed rows kept in the table for the second run.
    #[arg(long, default_value_t = 10_000_000)]
    history: u64,
}

/// Drain rate with `Retention::Keep` on an empty table and with `history` processed rows.
pub(crate) async fn history(url: &str, args: &HistoryArgs) -> Result<Report> {
    let o = &args.options;
    // Delete-on-publish keeps no history: keeping rows is what can slow down.
    let keep = Retention::Keep(Duration::from_secs(7 * 24 * 3600));
    let d = o.start(url, 1, keep).await?;
    let (config, relays, bench) = (&d.config, d.relays, &d.bench);

    bench.backlog(o.events, o.aggregates).await?;
    progress("draining with an empty history");
    let empty_rate = d.relay_rate(NullPublisher, config).await?;

    bench.reset().await?;
    bench.fill_history(args.history).await?;
    bench.fill(o.events, o.aggregates).await?;
    bench.settle().await?;
    progress(format!("draining with {} processed rows", args.history));
    let full_rate = d.relay_rate(NullPublisher, config).await?;

    let ratio = full_rate / empty_rate;
    Ok(Report {
        line: format!(
            "history: Retention::Keep, {full_rate:.0} events/s with {} processed rows vs \
             {empty_rate:.0} events/s empty, ratio {ratio:.2} (target >= 0.9: {}) [{}]",
            args.history,
            verdict(ratio >= 0.9),
            o.describe(config)
        ),
        json: json!({
            "scenario": "history", "retention": "keep", "history_rows": args.history,
            "events": o.events, "relays": relays, "batch_size": config.batch_size,
            "empty_events_per_s": empty_rate, "history_events_per_s": full_rate,
            "ratio": ratio, "target_met": ratio >= 0.9,
        }),
    })
}
