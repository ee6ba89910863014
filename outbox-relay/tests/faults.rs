//! Faults users meet, with the `outbox` binary as a process and NATS JetStream
//! (`OUTBOX_NATS_URL`, default 127.0.0.1:4222) as the broker: a broker outage
//! longer than the retry schedule, relays killed with SIGKILL while producers
//! write, and PostgreSQL cutting every session of the relays. Each test prints
//! its figures (run with `--nocapture` to see them).
#![cfg(feature = "nats")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::StreamExt;
use tokio::sync::MutexGuard;

use common::{
    dead_count, free_port, get, ids_where, qualified, sample, wait_for, wait_until_drained, Config,
    RelayProcess,
};
use pgoutbox_core::conformance::proxy::TcpProxy;
use pgoutbox_core::testing::{check_first_arrivals, event, resolve_url};
use pgoutbox_core::NewEvent;
use pgoutbox_nats::async_nats::jetstream::{self, stream};
use pgoutbox_nats::{async_nats, EventConsumer};
use pgoutbox_postgres::testing::{database_url, TestOutbox, Writer};
use uuid::Uuid;

/// These tests start several relay processes and put load on the machine; one at a
/// time, so that the bounds they assert are about the relay, not about each other.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The relay's message when it pauses for an outage, and when it resumes.
const OUTAGE_LOGGED: &str = "broker unavailable; claiming paused";
const RECOVERY_LOGGED: &str = "broker available again; claiming resumed";

use pgoutbox_nats::testing::nats_url;

fn nats_addr() -> SocketAddr {
    resolve_url(&nats_url())
}

/// A JetStream stream of this test's own, capturing `<prefix>.>`.
struct Stream {
    jetstream: jetstream::Context,
    name: String,
    prefix: String,
}

impl Stream {
    /// With JetStream's default duplicate window, as users have it.
    async fn create() -> Self {
        let tag = Uuid::new_v4().simple().to_string();
        let prefix = format!("outbox_faults_{tag}");
        let name = format!("OUTBOX_FAULTS_{tag}");
        let client = async_nats::connect(nats_url().as_str())
            .await
            .unwrap_or_else(|e| panic!("NATS with JetStream must run at {}: {e}", nats_url()));
        let jetstream = jetstream::new(client);
        let config = stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: stream::StorageType::Memory,
            max_age: Duration::from_secs(900),
            ..stream::Config::default()
        };
        jetstream
            .create_stream(config)
            .await
            .expect("create stream");
        Self {
            jetstream,
            name,
            prefix,
        }
    }

    async fn stored(&self) -> u64 {
        let mut handle = self.jetstream.get_stream(&self.name).await.unwrap();
        handle.info().await.unwrap().state.messages
    }

    async fn consumer(&self) -> EventConsumer {
        EventConsumer::durable(&self.jetstream, &self.name, "faults", "")
            .await
            .expect("consumer")
    }

    /// Every message in the stream, in stream order (duplicates included).
    async fn read_all(&self, limit: Duration) -> Vec<Uuid> {
        let total = self.stored().await;
        let consumer = self.consumer().await;
        let deadline = Instant::now() + limit;
        let mut ids = Vec::new();
        while (ids.len() as u64) < total {
            assert!(
                Instant::now() < deadline,
                "read {} of {total} messages within {limit:?}",
                ids.len()
            );
            fetch_acked(&consumer, 1000, Duration::from_millis(500), |id| {
                ids.push(id)
            })
            .await;
        }
        ids
    }

    /// Every publish to the stream's subjects from now on, as the wire carries it:
    /// a plain NATS subscription, which also sees the repeats JetStream does not
    /// store (same event id within its duplicate window). Ids in arrival order.
    async fn tap(&self) -> Tap {
        let client = async_nats::connect(nats_url().as_str()).await.unwrap();
        let mut subscription = client
            .subscribe(format!("{}.>", self.prefix))
            .await
            .unwrap();
        client.flush().await.unwrap();
        let ids: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
        let task = tokio::spawn({
            let ids = Arc::clone(&ids);
            async move {
                while let Some(message) = subscription.next().await {
                    let id = message
                        .headers
                        .as_ref()
                        .and_then(|h| h.get("Nats-Msg-Id"))
                        .and_then(|v| v.as_str().parse().ok())
                        .expect("a message with the event id in Nats-Msg-Id");
                    ids.lock().unwrap().push((id, Instant::now()));
                }
            }
        });
        Tap { client, ids, task }
    }

    async fn delete(&self) {
        let _ = self.jetstream.delete_stream(&self.name).await;
    }
}

/// What [`Stream::tap`] heard.
struct Tap {
    client: async_nats::Client,
    ids: Arc<Mutex<Vec<(Uuid, Instant)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Tap {
    /// Stop listening once the tap has heard `at_least` messages (at most `limit`).
    async fn stop(self, at_least: usize, limit: Duration) -> Vec<Uuid> {
        let heard = self.stop_timed(at_least, limit).await;
        heard.into_iter().map(|(id, _)| id).collect()
    }

    /// [`Tap::stop`], with when each message was heard.
    async fn stop_timed(self, at_least: usize, limit: Duration) -> Vec<(Uuid, Instant)> {
        let deadline = Instant::now() + limit;
        while self.ids.lock().unwrap().len() < at_least {
            assert!(
                Instant::now() < deadline,
                "the tap heard fewer than {at_least} messages"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.task.abort();
        drop(self.client);
        let ids = self.ids.lock().unwrap().clone();
        ids
    }
}

/// A relay config for `outbox`'s schema publishing to NATS at `nats` into `stream`;
/// its database sessions are named `app` (pg_stat_activity.application_name).
/// `rest`: further sections ([retry], [http]).
fn relay_config(outbox: &TestOutbox, app: &str, nats: &str, stream: &Stream, rest: &str) -> Config {
    let url = database_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    let url = format!("{url}{separator}application_name={app}");
    Config::new(&format!(
        r#"{head}broker_probe_max = "1s"

[broker]
kind = "nats"

[broker.nats]
url = "{nats}"
subject_prefix = "{prefix}"
timeout = "1s"
{rest}
"#,
        head = Config::head(&url, outbox.tables.schema().as_str()),
        prefix = stream.prefix,
    ))
}

/// Fetch up to `max` messages (waiting at most `wait`), acknowledge each and hand its
/// event id to `each` once acknowledged.
async fn fetch_acked(
    consumer: &EventConsumer,
    max: usize,
    wait: Duration,
    mut each: impl FnMut(Uuid),
) {
    for message in consumer.fetch(max, wait).await.unwrap() {
        let message = message.expect("an outbox event");
        message.ack().await.unwrap();
        each(message.id());
    }
}

/// For `relay_config`: no HTTP endpoint (several relays run side by side).
const NO_HTTP: &str = "[http]\nlisten = \"0\"\n";

fn events_table(outbox: &TestOutbox) -> String {
    qualified(outbox, outbox.tables.events())
}

async fn dead_letter_ids(outbox: &TestOutbox) -> Vec<Uuid> {
    ids_where(outbox, outbox.tables.events(), "dead_at IS NOT NULL").await
}

/// What each test starts with: its turn ([`ONE_AT_A_TIME`]), a fresh outbox and a
/// stream of its own.
async fn start() -> (MutexGuard<'static, ()>, TestOutbox, Stream) {
    let turn = ONE_AT_A_TIME.lock().await;
    let outbox = TestOutbox::new().await.unwrap();
    (turn, outbox, Stream::create().await)
}

/// Delete what [`start`] made.
async fn finish(stream: Stream, outbox: TestOutbox) {
    stream.delete().await;
    outbox.drop_schema().await.unwrap();
}

/// A small random generator for the test's choices; its seed is printed.
struct Dice(u64);

impl Dice {
    fn new() -> Self {
        let seed = (Uuid::new_v4().as_u128() as u64) | 1;
        println!("dice seed {seed}");
        Self(seed)
    }

    /// Uniform enough in `0..n` for picking relays and pauses.
    fn below(&mut self, n: u64) -> u64 {
        // xorshift64
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// What [`produce`] returns: each aggregate's ids in commit order, and when each
/// id was committed.
type Produced = (Vec<Vec<Uuid>>, HashMap<Uuid, Instant>);

/// What the producers write: `events` events over `aggregates` aggregates, with
/// `writer`, by `producers` concurrent producers in transactions of `per_tx`
/// events with `pause` between them.
#[derive(Clone, Copy)]
struct Load {
    /// Aggregate ids are `<name>-<n>`.
    name: &'static str,
    writer: Writer,
    producers: usize,
    aggregates: usize,
    events: usize,
    per_tx: usize,
    pause: Duration,
}

impl Load {
    /// The chaos tests' load: `events` events over 500 aggregates, written with
    /// `writer` by four producers, each a transaction of `per_tx` events every 900 ms.
    fn chaos(writer: Writer, events: usize, per_tx: usize) -> Self {
        Self {
            name: "o",
            writer,
            producers: 4,
            aggregates: 500,
            events,
            per_tx,
            pause: Duration::from_millis(900),
        }
    }

    /// One hot aggregate: `events` events by one producer, `per_tx` a transaction
    /// every 200 ms.
    fn hot(events: usize, per_tx: usize) -> Self {
        Self {
            name: "hot",
            writer: Writer::Table,
            producers: 1,
            aggregates: 1,
            events,
            per_tx,
            pause: Duration::from_millis(200),
        }
    }
}

/// Write `load`; each aggregate has one producer, so its events' commit order is
/// their order. Returns each aggregate's ids in that order, and when each id was
/// committed.
async fn produce(outbox: &TestOutbox, load: Load) -> Produced {
    let tasks = (0..load.producers).map(|p| {
        let outbox = outbox.clone();
        async move {
            // This producer's aggregates: p, p + producers, ...
            let mine: Vec<usize> = (p..load.aggregates).step_by(load.producers).collect();
            let count = load.events / load.producers;
            let mut runs: HashMap<usize, Vec<Uuid>> = HashMap::new();
            let mut committed = HashMap::new();
            for chunk in (0..count).collect::<Vec<_>>().chunks(load.per_tx) {
                let batch: Vec<(usize, NewEvent)> = chunk
                    .iter()
                    .map(|&k| {
                        let aggregate = mine[k % mine.len()];
                        (aggregate, event(&format!("{}-{aggregate}", load.name), k))
                    })
                    .collect();
                let events: Vec<NewEvent> = batch.iter().map(|(_, e)| e.clone()).collect();
                outbox.write(load.writer, &events, true).await.unwrap();
                let now = Instant::now();
                for (aggregate, event) in batch {
                    runs.entry(aggregate).or_default().push(event.id);
                    committed.insert(event.id, now);
                }
                tokio::time::sleep(load.pause).await;
            }
            (runs, committed)
        }
    });
    let mut runs = Vec::new();
    let mut committed = HashMap::new();
    for (mine, times) in join_all(tasks).await {
        runs.extend(mine.into_values());
        committed.extend(times);
    }
    (runs, committed)
}

/// [`produce`] on a task of its own, so that the test can act while it writes.
fn spawn_produce(outbox: &TestOutbox, load: Load) -> tokio::task::JoinHandle<Produced> {
    let outbox = outbox.clone();
    tokio::spawn(async move { produce(&outbox, load).await })
}

/// Until `producing` finishes: every 1-3 s (picked by [`Dice`]), kill one of
/// `relays` at random with SIGKILL and start a new one from `config` in its place.
/// Returns when each kill happened.
async fn kill_at_random_while<T>(
    producing: &tokio::task::JoinHandle<T>,
    relays: &mut Vec<RelayProcess>,
    config: &Config,
) -> Vec<Instant> {
    let mut dice = Dice::new();
    let mut kills = Vec::new();
    while !producing.is_finished() {
        tokio::time::sleep(Duration::from_millis(1000 + dice.below(2001))).await;
        let victim = dice.below(relays.len() as u64) as usize;
        relays.swap_remove(victim).kill();
        kills.push(Instant::now());
        relays.push(RelayProcess::start(&config.path));
    }
    kills
}

/// `n` relay processes on `config`.
fn start_relays(config: &Config, n: usize) -> Vec<RelayProcess> {
    (0..n).map(|_| RelayProcess::start(&config.path)).collect()
}

/// SIGTERM to each of `relays`; each must exit successfully within 25 s.
fn terminate_all(relays: Vec<RelayProcess>) {
    for relay in relays {
        let (exit, _) = relay.terminate(Duration::from_secs(25));
        assert!(exit.success(), "exit status {exit}");
    }
}

/// What the chaos tests demand: `events` produced in `runs`, none of them missing
/// from the stream (`arrivals`), at most `bound` repeats among the `publishes`, and
/// each aggregate's first arrivals in order in both.
fn assert_nothing_lost_and_in_order(
    runs: &[Vec<Uuid>],
    events: usize,
    arrivals: &[Uuid],
    publishes: &[Uuid],
    bound: usize,
) {
    assert_eq!(runs.iter().map(Vec::len).sum::<usize>(), events);
    let (lost, _) = tally(arrivals, runs);
    assert_eq!(lost, 0, "events lost");
    let (_, duplicates) = tally(publishes, runs);
    assert!(
        duplicates <= bound,
        "{duplicates} repeats, more than {bound}"
    );
    check_first_arrivals(arrivals, runs).expect("per-aggregate order in the stream");
    check_first_arrivals(publishes, runs).expect("per-aggregate order of the publishes");
}

/// Lost, and how many arrivals were repeats.
fn tally(arrivals: &[Uuid], runs: &[Vec<Uuid>]) -> (usize, usize) {
    let arrived: HashSet<Uuid> = arrivals.iter().copied().collect();
    let lost = runs
        .iter()
        .flatten()
        .filter(|id| !arrived.contains(id))
        .count();
    (lost, arrivals.len() - arrived.len())
}

/// NATS goes away for longer than the whole retry schedule (3 attempts, 1 s then
/// 2 s): no event loses an attempt or becomes a dead letter, the relay says so once
/// and shows it on /readyz and in `outbox_broker_up`, and after the broker is back
/// everything goes out in per-aggregate order. An event too large for NATS is
/// dead-lettered alone in the same run.
#[tokio::test(flavor = "multi_thread")]
async fn a_broker_outage_longer_than_the_retry_schedule_dead_letters_nothing() {
    let (_turn, outbox, stream) = start().await;
    let proxy = TcpProxy::start(nats_addr()).expect("proxy");
    let port = free_port();
    let config = relay_config(
        &outbox,
        "outbox-faults-outage",
        &format!("nats://{}", proxy.addr()),
        &stream,
        &format!(
            "[retry]\nmax_attempts = 3\nbase_delay = \"1s\"\nmax_delay = \"2s\"\n\n\
             [http]\nlisten = \"127.0.0.1:{port}\"\nstats_refresh = \"200ms\"\n"
        ),
    );
    let relay = RelayProcess::start(&config.path);
    let log = relay.log();
    let status = |path: &'static str| get(port, path).map(|r| r.0);
    wait_for("ready relay", Duration::from_secs(30), || {
        status("/readyz") == Some(200)
    })
    .await;

    proxy.cut();
    let outage_began = Instant::now();
    // Five events on each of eight orders, interleaved; and one too large for NATS.
    let events: Vec<NewEvent> = (0..40).map(|i| event(&format!("o-{}", i % 8), i)).collect();
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    let big = NewEvent::new(
        "order",
        "big",
        "order.created",
        &serde_json::json!({ "blob": "x".repeat(1_200_000) }),
    );
    outbox.write(Writer::Table, &events, true).await.unwrap();
    outbox
        .write(Writer::Table, std::slice::from_ref(&big), true)
        .await
        .unwrap();

    // The relay meets the outage at its first publish and pauses.
    let outage_body = || {
        get(port, "/readyz")
            .filter(|(code, body)| *code == 503 && body.contains("broker unavailable"))
            .is_some()
    };
    wait_for("outage on /readyz", Duration::from_secs(30), outage_body).await;
    // Outlast the retry schedule (1 s + 2 s) more than twice over.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(outage_body(), "the outage ended by itself");
    let metrics = get(port, "/metrics").expect("metrics").1;
    assert_eq!(sample(&metrics, "outbox_broker_up"), Some(0.0), "{metrics}");
    let attempts: Vec<(Uuid, i32)> = sqlx::query_as(&format!(
        "SELECT id, attempts FROM {} WHERE id = ANY($1)",
        events_table(&outbox)
    ))
    .bind(&ids)
    .fetch_all(&outbox.pool)
    .await
    .unwrap();
    assert_eq!(attempts.len(), ids.len());
    assert!(
        attempts.iter().all(|(_, n)| *n == 0),
        "the outage counted attempts: {attempts:?}"
    );
    assert!(
        dead_letter_ids(&outbox)
            .await
            .iter()
            .all(|id| *id == big.id),
        "an outage made dead letters"
    );
    let outage = outage_began.elapsed();

    proxy.restore();
    let restored = Instant::now();
    wait_until_drained(&outbox, Duration::from_secs(60)).await;
    let drained_after = restored.elapsed();
    wait_for("ready relay", Duration::from_secs(30), || {
        status("/readyz") == Some(200)
    })
    .await;
    let metrics = get(port, "/metrics").expect("metrics").1;
    assert_eq!(sample(&metrics, "outbox_broker_up"), Some(1.0), "{metrics}");
    let (exit, _) = relay.terminate(Duration::from_secs(25));
    assert!(exit.success(), "exit status {exit}");

    assert_eq!(dead_letter_ids(&outbox).await, vec![big.id]);
    let arrivals = stream.read_all(Duration::from_secs(30)).await;
    let runs: Vec<Vec<Uuid>> = (0..8)
        .map(|a| ids.iter().copied().skip(a).step_by(8).collect())
        .collect();
    let (lost, duplicates) = tally(&arrivals, &runs);
    assert_eq!(lost, 0, "events lost");
    check_first_arrivals(&arrivals, &runs).expect("per-aggregate order");
    assert_eq!(log.count(OUTAGE_LOGGED), 1, "{:#?}", log.lines());
    assert_eq!(log.count(RECOVERY_LOGGED), 1, "{:#?}", log.lines());
    println!(
        "broker outage: {:.1} s with max_attempts 3 (schedule 1 s + 2 s); {} events \
         delivered {:.1} s after the broker came back, {} stored repeats, 0 attempts \
         counted, 1 dead letter (the oversized event), outage and recovery logged once each",
        outage.as_secs_f64(),
        ids.len(),
        drained_after.as_secs_f64(),
        duplicates,
    );
    finish(stream, outbox).await;
}

/// Four relay processes drain while producers write 40,000 events over 500
/// aggregates (bursts of 2,000 a second, so that relays are often mid-batch when
/// killed), and a random relay is killed with SIGKILL every 1-3 s and started
/// again. Then the whole stream is read: nothing is lost, repeats stay within what
/// the killed relays had in flight, and the first arrivals of each aggregate's
/// events are in order.
#[tokio::test(flavor = "multi_thread")]
async fn relays_killed_at_random_lose_nothing_and_keep_order() {
    let load = Load::chaos(Writer::Table, 40_000, 500);
    relays_killed_while_producing("chaos", &[load], 5).await;
}

/// A hot aggregate under chaos: four relay processes drain while one producer
/// writes 20,000 events of a single aggregate (500 a transaction) and four others
/// write 8,000 events over 500 aggregates as background traffic; a random relay is
/// killed with SIGKILL every 1-3 s and started again. Nothing is lost, repeats stay
/// within what the killed relays had in flight, and the hot aggregate's first
/// arrivals (and every other aggregate's) are in insertion order.
#[tokio::test(flavor = "multi_thread")]
async fn relays_killed_at_random_keep_a_hot_aggregate_in_order() {
    let hot = Load::hot(20_000, 500);
    let background = Load::chaos(Writer::Table, 8_000, 250);
    relays_killed_while_producing("hot chaos", &[hot, background], 3).await;
}

/// Four relay processes drain while `loads` are written, the first one's producers
/// setting the pace: until they finish, a random relay is killed with SIGKILL every
/// 1-3 s and started again (at least `min_kills` times). Then the whole stream is
/// read: nothing is lost, repeats stay within what the killed relays had in
/// flight, and the first arrivals of each aggregate's events are in order.
async fn relays_killed_while_producing(what: &str, loads: &[Load], min_kills: usize) {
    const RELAYS: usize = 4;
    // As `Config::head` sets them.
    const BATCH_SIZE: usize = 50;
    const WORKERS: usize = 2;
    let (_turn, outbox, stream) = start().await;
    let began = Instant::now();
    let tap = stream.tap().await;
    let config = relay_config(
        &outbox,
        "outbox-faults-chaos",
        &nats_url(),
        &stream,
        NO_HTTP,
    );
    let mut relays = start_relays(&config, RELAYS);

    let mut producing: Vec<_> = loads
        .iter()
        .map(|&load| spawn_produce(&outbox, load))
        .collect();
    let pace = producing.remove(0);
    let kills = kill_at_random_while(&pace, &mut relays, &config)
        .await
        .len();
    let (mut runs, _) = pace.await.unwrap();
    for others in producing {
        runs.extend(others.await.unwrap().0);
    }
    let produced_in = began.elapsed();
    let drain_began = Instant::now();
    wait_until_drained(&outbox, Duration::from_secs(90)).await;
    let drained_in = drain_began.elapsed();
    terminate_all(relays);

    let events: usize = loads.iter().map(|l| l.events).sum();
    let arrivals = stream.read_all(Duration::from_secs(60)).await;
    let (lost, stored_repeats) = tally(&arrivals, &runs);
    let published = tap.stop(events, Duration::from_secs(30)).await;
    let (_, duplicates) = tally(&published, &runs);
    let bound = kills * BATCH_SIZE * WORKERS;
    let written: Vec<String> = loads
        .iter()
        .map(|l| {
            format!(
                "{} events over {} `{}` aggregates",
                l.events, l.aggregates, l.name
            )
        })
        .collect();
    println!(
        "{what}: {RELAYS} relays (batch {BATCH_SIZE}, {WORKERS} workers), {} written in \
         {:.1} s while {kills} relays were killed with SIGKILL; drained {:.1} s after the \
         last write; {} publishes, {duplicates} of them repeats (bound {bound} = kills x \
         batch x workers); {} messages stored: {lost} lost, {stored_repeats} repeats \
         (JetStream dropped the others by event id); total {:.1} s",
        written.join(" and "),
        produced_in.as_secs_f64(),
        drained_in.as_secs_f64(),
        published.len(),
        arrivals.len(),
        began.elapsed().as_secs_f64(),
    );
    assert!(
        kills >= min_kills,
        "only {kills} kills: the run was too short to mean much"
    );
    assert_nothing_lost_and_in_order(&runs, events, &arrivals, &published, bound);
    assert_eq!(dead_count(&outbox).await, 0);
    finish(stream, outbox).await;
}

/// WAL mode: two relays on one slot (the server lets one read it, the other stands
/// by) while producers write 20,000 events to the WAL; the relay reading the slot
/// is killed with SIGKILL every 1-3 s (at least 10 times) and started again. Then
/// the whole stream is read: nothing is lost, repeats stay bounded, the first
/// arrivals of each aggregate's events are in order, and after each kill the
/// standby publishes again within 5 s.
#[tokio::test(flavor = "multi_thread")]
async fn wal_relays_killed_at_random_lose_nothing_and_the_standby_takes_over() {
    let load = Load::chaos(Writer::Wal, 20_000, 100);
    let (_turn, outbox, stream) = start().await;
    let began = Instant::now();
    let tap = stream.tap().await;
    // The outbox's default slot and publication, which the producers look for.
    let _cleanup = common::DropSlot::defaults(&outbox).await;
    let config = relay_config(
        &outbox,
        "outbox-faults-wal",
        &nats_url(),
        &stream,
        &format!("{NO_HTTP}\n[wal]\nenabled = true\n"),
    );
    let migrated = common::command(&config.path, &["migrate"])
        .output()
        .unwrap();
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let mut relays = start_relays(&config, 2);

    let producing = spawn_produce(&outbox, load);
    // Both are killed in turn: whichever reads the slot, the other takes over.
    let kills = kill_at_random_while(&producing, &mut relays, &config).await;
    let (runs, _) = producing.await.unwrap();
    let produced_in = began.elapsed();
    let published = tap.stop_timed(load.events, Duration::from_secs(90)).await;
    terminate_all(relays);
    let arrivals = stream.read_all(Duration::from_secs(60)).await;
    let (lost, stored_repeats) = tally(&arrivals, &runs);
    let ids: Vec<Uuid> = published.iter().map(|(id, _)| *id).collect();
    let (_, duplicates) = tally(&ids, &runs);
    // After each kill while producers were writing (they commit several times a
    // second), the next publish comes within 5 s.
    let longest_gap = kills
        .iter()
        .filter(|&&kill| kill + Duration::from_secs(1) < began + produced_in)
        .filter_map(|&kill| {
            published
                .iter()
                .map(|(_, at)| *at)
                .find(|&at| at > kill)
                .map(|at| at - kill)
        })
        .max()
        .unwrap_or_default();
    // A killed relay repeats at most what it published since its last acknowledgement
    // reached the server (status every second, some 430 events a second here).
    let bound = kills.len() * 1_000;
    println!(
        "wal chaos: 2 relays on one slot, {} events over {} aggregates written to \
         the WAL by {} producers in {:.1} s while {} relays were killed with SIGKILL; \
         longest wait for the next publish after a kill {:.2} s; {} publishes, {duplicates} of \
         them repeats (bound {bound}); {} messages stored: {lost} lost, {stored_repeats} repeats; \
         total {:.1} s",
        load.events,
        load.aggregates,
        load.producers,
        produced_in.as_secs_f64(),
        kills.len(),
        longest_gap.as_secs_f64(),
        published.len(),
        arrivals.len(),
        began.elapsed().as_secs_f64(),
    );
    assert!(kills.len() >= 10, "only {} kills", kills.len());
    assert_nothing_lost_and_in_order(&runs, load.events, &arrivals, &ids, bound);
    assert!(
        longest_gap < Duration::from_secs(5),
        "no publish for {longest_gap:?} after a kill"
    );
    finish(stream, outbox).await;
}

/// While two relays drain live traffic, PostgreSQL terminates every session of
/// theirs, three times. Each time the relays publish events committed after the
/// cut within 5 s, without a restart; nothing is lost and order holds.
#[tokio::test(flavor = "multi_thread")]
async fn relays_recover_by_themselves_when_postgresql_drops_their_sessions() {
    const APP: &str = "outbox-faults-restart";
    let (_turn, outbox, stream) = start().await;
    let config = relay_config(&outbox, APP, &nats_url(), &stream, NO_HTTP);
    let relays = start_relays(&config, 2);
    // Publishes timed as the wire carries them (a plain subscription). A pull
    // consumer times them when its fetch returns, which adds the consumer's own
    // stalls: a fetch whose end the server does not signal waits for the client's
    // timer, its expiry + 5 s.
    let tap = stream.tap().await;
    let producing = spawn_produce(
        &outbox,
        Load {
            name: "o",
            writer: Writer::Table,
            producers: 2,
            aggregates: 200,
            events: 6000,
            per_tx: 50,
            pause: Duration::from_millis(150),
        },
    );

    let mut cuts = Vec::new();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let terminated: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(APP)
        .fetch_all(&outbox.pool)
        .await
        .unwrap();
        assert!(!terminated.is_empty(), "no relay session to terminate");
        cuts.push((Instant::now(), terminated.len()));
    }
    let (runs, committed) = producing.await.unwrap();
    wait_until_drained(&outbox, Duration::from_secs(60)).await;
    let total: usize = runs.iter().map(Vec::len).sum();
    let published = tap.stop_timed(total, Duration::from_secs(30)).await;
    terminate_all(relays);
    let stored = stream.read_all(Duration::from_secs(30)).await;
    let (lost, stored_repeats) = tally(&stored, &runs);
    let ids: Vec<Uuid> = published.iter().map(|(id, _)| *id).collect();
    let (_, duplicates) = tally(&ids, &runs);
    // A cut fails the record of every batch in flight (one per worker of each
    // relay: `Config::head`'s 2 workers x 50), which is published again.
    let bound = cuts.len() * 2 * 2 * 50;
    // Recovery: from a cut to the first publish of an event committed after it.
    let recoveries: Vec<Duration> = cuts
        .iter()
        .map(|(cut, _)| {
            published
                .iter()
                .filter(|(id, _)| committed[id] > *cut)
                .map(|(_, at)| at.duration_since(*cut))
                .min()
                .expect(
                    "no event committed after a cut was published: the producers stopped before it",
                )
        })
        .collect();
    println!(
        "sessions cut: 2 relays, {total} events over 200 aggregates; sessions terminated \
         per cut {:?}; first event committed after each cut published after {:?}; {} \
         publishes, {duplicates} of them repeats (bound {bound}); {lost} lost, \
         {stored_repeats} repeats in the stream",
        cuts.iter().map(|(_, n)| n).collect::<Vec<_>>(),
        recoveries,
        ids.len(),
    );
    assert_nothing_lost_and_in_order(&runs, total, &stored, &ids, bound);
    for recovery in &recoveries {
        assert!(
            *recovery < Duration::from_secs(5),
            "relays took {recovery:?} to publish again"
        );
    }
    assert_eq!(dead_count(&outbox).await, 0);
    finish(stream, outbox).await;
}
