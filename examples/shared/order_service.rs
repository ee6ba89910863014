//! The order service shared by the examples: their start ([`main`]: tracing,
//! command line, the database with the `orders` table), creating orders (each order
//! row and its `order.created` event in one transaction), waiting until this run's
//! events are consumed, and shutdown.
//!
//! Each example includes this file with `#[path = "shared/order_service.rs"] mod
//! order_service;` and keeps its broker-specific parts (publisher, consumer) itself.

// Each example uses a subset of these helpers (the quickstart has no consumer).
#![allow(dead_code)]

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use pgoutbox::envelope::Metadata;
use pgoutbox::postgres::{migrate, relay_pool, Inbox, Outbox, PgStore, Processed, Tables};
use pgoutbox::{redact_url, NewEvent, Publisher, Relay, RelayConfig, TypedEvent};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The event this service publishes: producers serialise it into the outbox,
/// consumers decode it from the broker's message with their adapter's `decode`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct OrderCreated {
    pub(crate) order_id: i64,
    pub(crate) customer: String,
    pub(crate) total_cents: i64,
}

impl TypedEvent for OrderCreated {
    fn event_type(&self) -> &str {
        "order.created"
    }
}

impl std::fmt::Display for OrderCreated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "order {} for {}: {} cents",
            self.order_id, self.customer, self.total_cents
        )
    }
}

/// The examples' error type.
pub(crate) type Error = Box<dyn std::error::Error>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// How long a demo run (`--orders N`) waits for its events to be consumed.
const DEMO_TIMEOUT: Duration = Duration::from_secs(60);

/// An example: its name (that of its schema `example_<name>`, and the prefix of its
/// log lines), its `--help` text, how many orders it creates without arguments and
/// what it logs.
pub(crate) struct Example {
    pub(crate) name: &'static str,
    /// What it does, the first lines of `--help`.
    pub(crate) about: &'static str,
    /// The last lines of `--help`: its defaults and its broker's settings.
    pub(crate) after_help: &'static str,
    /// The orders to create without `--orders N` or `--forever`; none: one a second
    /// until Ctrl-C.
    pub(crate) default_orders: Option<u32>,
    /// What to log to stderr unless `RUST_LOG` says otherwise.
    pub(crate) log_filter: &'static str,
}

/// Start the example: set up logging, read the command line, connect to the
/// database and create the example's schema (see [`connect`]), then `run(db,
/// orders)` with the number of orders to create (none: until Ctrl-C). Closes the
/// pool afterwards; on an error, prints it prefixed with the example's name and
/// exits with status 1.
pub(crate) async fn main<F, Fut>(example: Example, run: F)
where
    F: FnOnce(Database, Option<u32>) -> Fut,
    Fut: Future<Output = Result<(), Error>>,
{
    init_tracing(example.log_filter);
    let orders = orders_arg(
        example.name,
        example.about,
        example.after_help,
        example.default_orders,
    );
    let result = async {
        let db = connect(example.name).await?;
        let pool = db.pool.clone();
        run(db, orders).await?;
        pool.close().await;
        Ok(())
    };
    exit_on_error(example.name, result.await);
}

/// Log to stderr, filtered by `RUST_LOG` or else `default_filter`.
pub(crate) fn init_tracing(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal, not in a file or a pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Print the error prefixed with the example's name and exit with status 1.
pub(crate) fn exit_on_error(name: &str, result: Result<(), Error>) {
    if let Err(error) = result {
        eprintln!("{name}: {error}");
        std::process::exit(1);
    }
}

/// The command line of every example.
#[derive(clap::Parser)]
struct Args {
    /// Create N orders, wait until their events are published (and consumed), then exit.
    #[arg(long, value_name = "N", conflicts_with = "forever")]
    orders: Option<u32>,
    /// Create an order every second until Ctrl-C (the default unless stated below).
    #[arg(long)]
    forever: bool,
}

/// Parse the command line of the example `name` (`about` and `after_help` are its
/// `--help` text): the number of orders to create, `--orders N`; none (one a second
/// until Ctrl-C) with `--forever`; otherwise `default`. Exits with the usage on
/// `--help` or a bad argument.
pub(crate) fn orders_arg(
    name: &'static str,
    about: &'static str,
    after_help: &'static str,
    default: Option<u32>,
) -> Option<u32> {
    use clap::{CommandFactory, FromArgMatches};
    let command = Args::command().name(name).about(about).after_help(format!(
        "{after_help}\n\nDATABASE_URL defaults to {DEFAULT_DATABASE_URL}; the example keeps \
             its outbox and its `orders` table in the schema `example_{name}`."
    ));
    let args = Args::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    if args.forever {
        None
    } else {
        args.orders.or(default)
    }
}

/// The service's database: the pool, the outbox's tables and the `orders` table, all
/// in the example's own schema (so that examples never see each other's events).
pub(crate) struct Database {
    pub(crate) pool: PgPool,
    pub(crate) tables: Tables,
    orders: String,
}

/// Connect to `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`), then
/// create the schema `example_<name>` with the outbox (idempotent) and the business
/// table `orders` in it.
pub(crate) async fn connect(name: &str) -> Result<Database, Error> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_string());
    let pool = relay_pool(&url, 4, Duration::from_secs(60))
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", redact_url(&url)))?;
    let tables = Tables::in_schema(&format!("example_{name}"))?;
    migrate(&pool, &tables).await?;
    let orders = format!("{}.orders", tables.schema().quoted());
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {orders} (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            customer text NOT NULL,
            total_cents bigint NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now())"
    ))
    .execute(&pool)
    .await?;
    Ok(Database {
        pool,
        tables,
        orders,
    })
}

/// The relay settings of the examples: poll often, so that the demo is quick.
pub(crate) fn relay_config() -> RelayConfig {
    RelayConfig::default().poll_interval(Duration::from_millis(50))
}

/// A token cancelled at Ctrl-C (the caller may cancel it too).
pub(crate) fn stop_on_ctrl_c(name: &'static str) -> CancellationToken {
    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("{name}: Ctrl-C, finishing the batch in flight");
            }
            stop.cancel();
        }
    });
    stop
}

/// Event ids committed by this run and not consumed yet, and whether all are committed.
#[derive(Clone, Default)]
pub(crate) struct Pending(Arc<Mutex<(HashSet<Uuid>, bool)>>);

impl Pending {
    fn lock(&self) -> MutexGuard<'_, (HashSet<Uuid>, bool)> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The event `id` is about to commit.
    fn expect(&self, id: Uuid) {
        self.lock().0.insert(id);
    }

    /// Every event of this run is committed.
    fn all_committed(&self) {
        self.lock().1 = true;
    }

    /// The event `id` was consumed.
    pub(crate) fn consumed(&self, id: Uuid) {
        self.lock().0.remove(&id);
    }

    /// Every event of this run is committed and consumed.
    pub(crate) fn is_done(&self) -> bool {
        let pending = self.lock();
        pending.1 && pending.0.is_empty()
    }
}

/// Create orders, each with its event in the same transaction: `count` of them, or one
/// a second until `stop` is cancelled (Ctrl-C). With `pending`, each event id is
/// recorded there before its commit (the consumer may see the event right after it).
pub(crate) async fn produce(
    name: &str,
    db: &Database,
    outbox: &Outbox,
    count: Option<u32>,
    pending: Option<&Pending>,
    stop: &CancellationToken,
) -> Result<(), Error> {
    let customers = ["ada", "grace", "linus", "barbara"];
    let mut n: u32 = 0;
    while !stop.is_cancelled() && count.is_none_or(|c| n < c) {
        let customer = customers[n as usize % customers.len()];
        let total_cents = 1_000 + i64::from(n) * 250;
        let mut tx = db.pool.begin().await?;
        let order_id: i64 = sqlx::query_scalar(&format!(
            "INSERT INTO {} (customer, total_cents) VALUES ($1, $2) RETURNING id",
            db.orders
        ))
        .bind(customer)
        .bind(total_cents)
        .fetch_one(&mut *tx)
        .await?;
        let created = OrderCreated {
            order_id,
            customer: customer.to_owned(),
            total_cents,
        };
        let event = NewEvent::typed("order", order_id.to_string(), &created)?;
        outbox.enqueue(&mut tx, &event).await?;
        if let Some(pending) = pending {
            pending.expect(event.id);
        }
        tx.commit().await?;
        eprintln!(
            "{name}: created order {order_id} for {customer} (event {})",
            event.id
        );
        n += 1;
        if count.is_none() {
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
    if let Some(pending) = pending {
        pending.all_committed();
    }
    Ok(())
}

/// When a consumer loop should return.
pub(crate) struct ConsumeUntil {
    demo: bool,
    deadline: tokio::time::Instant,
}

impl ConsumeUntil {
    /// In demo mode, until every event of this run was consumed (at most 60 s);
    /// otherwise until Ctrl-C.
    pub(crate) fn new(demo: bool) -> Self {
        Self {
            demo,
            deadline: tokio::time::Instant::now() + DEMO_TIMEOUT,
        }
    }

    /// Whether the demo is complete: every event of this run was consumed.
    pub(crate) fn done(&self, pending: &Pending) -> bool {
        self.demo && pending.is_done()
    }

    /// Completes with an error at the demo's deadline; never outside demo mode.
    pub(crate) async fn timeout(&self) -> Error {
        if self.demo {
            tokio::time::sleep_until(self.deadline).await;
            "not every event was consumed within 60 s".into()
        } else {
            std::future::pending().await
        }
    }
}

/// A broker's consumer, as the shared [`consume`] loop uses it.
pub(crate) trait Deliveries {
    /// One received message.
    type Message;

    /// Wait a little for messages: some, or none yet (the loop then checks whether
    /// the demo is complete and asks again). An error ends the loop.
    async fn next(&mut self) -> Result<Vec<Self::Message>, Error>;

    /// The message's metadata, in whichever envelope it came.
    fn metadata(&self, message: &Self::Message) -> Result<Metadata, Error>;

    /// The message's body.
    fn body<'m>(&self, message: &'m Self::Message) -> &'m [u8];

    /// Where the message was, for the log line (e.g. a partition and offset).
    fn place(&self, _message: &Self::Message) -> String {
        String::new()
    }

    /// Settle the message once processed, or skipped as unreadable: acknowledge
    /// it, commit its offset, delete it.
    async fn settle(&mut self, message: Self::Message) -> Result<(), Error>;
}

/// Process events once each (the inbox skips duplicates), settling each message
/// after the inbox transaction committed. In demo mode, return when every event
/// of this run was consumed (at most 60 s); otherwise at Ctrl-C. Returns how many
/// events were processed (duplicates not counted).
pub(crate) async fn consume(
    name: &str,
    mut deliveries: impl Deliveries,
    pool: &PgPool,
    inbox: &Inbox,
    demo: bool,
    pending: &Pending,
    stop: &CancellationToken,
) -> Result<u64, Error> {
    let until = ConsumeUntil::new(demo);
    let mut processed = 0;
    loop {
        if until.done(pending) {
            return Ok(processed);
        }
        let messages = tokio::select! {
            () = stop.cancelled() => return Ok(processed),
            error = until.timeout() => return Err(error),
            messages = deliveries.next() => messages?,
        };
        for message in messages {
            let read = deliveries.metadata(&message).and_then(|meta| {
                let order: OrderCreated = meta.decode(deliveries.body(&message))?;
                Ok((meta, order))
            });
            let id = match read {
                Ok((meta, order)) => {
                    let place = deliveries.place(&message);
                    let describe = || {
                        format!(
                            "{} event {}{place}: {order}",
                            meta.event_type, meta.event_id
                        )
                    };
                    if process(inbox, pool, meta.event_id, describe).await? {
                        processed += 1;
                    }
                    Some(meta.event_id)
                }
                // Unreadable now is unreadable on every redelivery: log and drop it.
                Err(error) => {
                    eprintln!("{name}: skipping a message: {error}");
                    None
                }
            };
            deliveries.settle(message).await?;
            if let Some(id) = id {
                pending.consumed(id);
            }
        }
    }
}

/// Process the event `id` once (the inbox skips duplicates) and print it as
/// `billing: <describe()>`. Returns whether it was processed now (not a duplicate).
pub(crate) async fn process(
    inbox: &Inbox,
    pool: &PgPool,
    id: Uuid,
    describe: impl FnOnce() -> String,
) -> Result<bool, Error> {
    let outcome = inbox
        .process(pool, id, |_conn| {
            // Business effects go here, on `_conn`, in the inbox's transaction.
            Box::pin(async { Ok::<(), sqlx::Error>(()) })
        })
        .await?;
    match outcome {
        Processed::First(()) => {
            println!("billing: {}", describe());
            Ok(true)
        }
        Processed::Duplicate => {
            println!("billing: duplicate event {id} skipped");
            Ok(false)
        }
    }
}

/// The order service on a broker: a relay over the outbox table publishing with
/// `publisher`, the producer creating orders (`orders`: that many, else one a
/// second until Ctrl-C) and the consumer processing `deliveries` once each with
/// the inbox `inbox_name`, until the demo is complete or Ctrl-C. Returns the relay,
/// to flush or drop its publisher.
pub(crate) async fn serve<P: Publisher>(
    name: &'static str,
    db: &Database,
    publisher: P,
    inbox_name: &str,
    orders: Option<u32>,
    deliveries: impl Deliveries,
) -> Result<Relay<PgStore, P>, Error> {
    let outbox = Outbox::new(db.tables.clone());
    let store = PgStore::new(db.pool.clone(), db.tables.clone());
    let relay = Relay::new(store, publisher).with_config(relay_config());
    let inbox = Inbox::new(&outbox, inbox_name)?;

    let stop = stop_on_ctrl_c(name);
    let pending = Pending::default();
    let demo = orders.is_some();
    let processed = run_service(
        &stop,
        relay.run(stop.clone().cancelled_owned()),
        produce(name, db, &outbox, orders, Some(&pending), &stop),
        consume(name, deliveries, &db.pool, &inbox, demo, &pending, &stop),
    )
    .await?;
    eprintln!(
        "{name}: published {} events, processed {processed}, bye",
        relay.stats().snapshot().published
    );
    Ok(relay)
}

/// Run the relay, the producer and the consumer until the consumer returns (or any
/// fails), then stop the relay; returns the number of events processed.
pub(crate) async fn run_service(
    stop: &CancellationToken,
    relay: impl Future<Output = ()>,
    producer: impl Future<Output = Result<(), Error>>,
    consumer: impl Future<Output = Result<u64, Error>>,
) -> Result<u64, Error> {
    let app = async {
        let result = tokio::try_join!(producer, consumer);
        stop.cancel();
        result
    };
    let ((), app) = tokio::join!(relay, app);
    let ((), processed) = app?;
    Ok(processed)
}
