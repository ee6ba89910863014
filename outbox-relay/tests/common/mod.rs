//! Shared by the tests that run the `outbox` binary as a process against the real
//! PostgreSQL: config files, relay processes, the HTTP endpoints, the outbox table.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgoutbox_postgres::testing::{database_url, TestOutbox};
use pgoutbox_postgres::Ident;
use uuid::Uuid;

pub const BIN: &str = env!("CARGO_BIN_EXE_outbox");

/// A config file in a temporary directory.
pub struct Config {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl Config {
    pub fn new(text: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("outbox.toml");
        std::fs::write(&path, text).expect("write config");
        Self { _dir: dir, path }
    }

    /// A working config for `schema`, HTTP on `listen` ("0" for none).
    pub fn for_schema(schema: &str, listen: &str) -> Self {
        Self::with_broker(schema, listen, "[broker]\nkind = \"stdout\"\n")
    }

    /// [`Config::for_schema`] for `outbox`'s schema with HTTP on a free port of
    /// 127.0.0.1; the config and the port.
    pub fn with_http(outbox: &TestOutbox) -> (Self, u16) {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        (
            Self::for_schema(outbox.tables.schema().as_str(), &listen),
            port,
        )
    }

    /// [`Config::for_schema`] with `broker` (its `[broker]` section, and what
    /// follows it) in place of the stdout broker.
    pub fn with_broker(schema: &str, listen: &str, broker: &str) -> Self {
        Self::with_broker_at(&database_url(), schema, listen, broker)
    }

    /// [`Config::with_broker`] on the database at `url`.
    pub fn with_broker_at(url: &str, schema: &str, listen: &str, broker: &str) -> Self {
        Self::new(&format!(
            r#"{head}pending_refresh = "200ms"

[retry]
max_attempts = 3
base_delay = "100ms"
max_delay = "1s"

[http]
listen = "{listen}"
stats_refresh = "200ms"

{broker}"#,
            head = Self::head(url, schema)
        ))
    }

    /// The `[database]` and `[tables]` sections and the start of `[relay]` that
    /// every test config shares: a small batch, two claim loops, a fast poll.
    /// Further `[relay]` keys may follow it directly.
    pub fn head(url: &str, schema: &str) -> String {
        format!(
            r#"
[database]
url = "{url}"
connect_timeout = "5s"

[tables]
schema = "{schema}"

[relay]
batch_size = 50
workers = 2
poll_interval = "50ms"
shutdown_timeout = "20s"
"#
        )
    }
}

pub fn command(config: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    // The binary's variables (OUTBOX_*, e.g. OUTBOX_NATS_URL, which scripts/test.sh
    // exports) override the config file: none may leak in from the test's environment.
    for (var, _) in std::env::vars_os() {
        if var.to_string_lossy().starts_with("OUTBOX_") {
            cmd.env_remove(var);
        }
    }
    cmd.env_remove("RUST_LOG");
    cmd.arg("--config").arg(config).args(args);
    cmd.stdin(Stdio::null());
    cmd
}

/// Run `outbox` with `args` to its end; its standard output. Fails the test, with
/// both outputs, when it does not exit 0.
pub fn run_ok(config: &Path, args: &[&str]) -> String {
    let out = command(config, args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "outbox {args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A durable consumer of the JetStream `stream` from its start, once the relay
/// that creates the stream as it starts has done so (at most 30 s), with the
/// client it reads through (`OUTBOX_NATS_URL`).
pub async fn stream_consumer(
    stream: &str,
    durable: &str,
) -> (pgoutbox_nats::NatsPublisher, pgoutbox_nats::EventConsumer) {
    let publisher = pgoutbox_nats::NatsConfig::from_env()
        .unwrap()
        .connect()
        .await
        .unwrap();
    let consumer = poll(
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || {
            pgoutbox_nats::EventConsumer::durable(publisher.jetstream(), stream, durable, "")
                .await
                .ok()
        },
    )
    .await
    .unwrap_or_else(|| panic!("no stream {stream} within 30 s"));
    (publisher, consumer)
}

/// Fetch and acknowledge messages of `consumer`, handing each to `take`, which
/// returns how many the test has now, until it has `want`; fails the test after
/// `limit`.
pub async fn receive(
    consumer: &pgoutbox_nats::EventConsumer,
    want: usize,
    limit: Duration,
    mut take: impl FnMut(pgoutbox_nats::EventMessage) -> usize,
) {
    let deadline = Instant::now() + limit;
    let mut have = 0;
    while have < want {
        assert!(
            Instant::now() < deadline,
            "{have} of {want} messages within {limit:?}"
        );
        for message in consumer
            .fetch(500, Duration::from_millis(500))
            .await
            .unwrap()
        {
            let message = message.unwrap();
            message.ack().await.unwrap();
            have = take(message);
        }
    }
}

/// A relay process: its stdout (the stdout broker's JSON lines) and its stderr (the
/// log) are collected; the log is printed when a test fails with the process alive.
pub struct RelayProcess {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    log: Log,
    readers: Vec<std::thread::JoinHandle<()>>,
}

/// The lines a relay process wrote to stderr so far.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// Lines containing `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }
}

/// Collect the lines of `source` into `sink` on a thread of their own.
fn collect(
    source: impl Read + Send + 'static,
    sink: Arc<Mutex<Vec<String>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(source).lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    })
}

impl RelayProcess {
    pub fn start(config: &Path) -> Self {
        Self::spawn(command(config, &["relay"]))
    }

    pub fn spawn(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn relay");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let log = Log::default();
        let readers = vec![
            collect(child.stdout.take().expect("stdout"), Arc::clone(&lines)),
            collect(child.stderr.take().expect("stderr"), Arc::clone(&log.0)),
        ];
        Self {
            child,
            lines,
            log,
            readers,
        }
    }

    /// Its stderr, also readable after the process ended.
    pub fn log(&self) -> Log {
        self.log.clone()
    }

    pub fn published_ids(&self) -> Vec<Uuid> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
                v["id"].as_str().expect("id").parse().expect("uuid")
            })
            .collect()
    }

    /// SIGTERM, then the exit status within `limit`.
    pub fn terminate(mut self, limit: Duration) -> (std::process::ExitStatus, Vec<Uuid>) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        assert!(sent.success());
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "relay did not exit within {limit:?} of SIGTERM; its log:\n{}",
                    self.log.lines().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        self.join_readers();
        (status, self.published_ids())
    }

    /// SIGKILL: no shutdown, as in a crash or an OOM kill.
    pub fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("wait");
        self.join_readers();
    }

    fn join_readers(&mut self) {
        for reader in self.readers.drain(..) {
            reader.join().expect("reader");
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let lines = self.log.lines();
            let tail = &lines[lines.len().saturating_sub(40)..];
            eprintln!(
                "relay {} log (last {} lines):\n{}",
                self.child.id(),
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// GET `path`; (status, body), or None while nothing listens.
pub fn get(port: u16, path: &str) -> Option<(u16, String)> {
    request(port, "GET", path, &[], None)
}

/// An HTTP/1.1 request to 127.0.0.1:`port` with `headers` and a JSON `body`;
/// (status, body), or None while nothing listens.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .ok()?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).ok()?;
    stream.write_all(body.unwrap_or_default().as_bytes()).ok()?;
    // Read the head, then the body by its length: a server may keep the
    // connection open after answering (chromedriver does), whatever we asked.
    let mut raw = Vec::new();
    let mut buffer = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let n = stream.read(&mut buffer).ok()?;
        if n == 0 {
            return None;
        }
        raw.extend_from_slice(&buffer[..n]);
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let length = head.lines().find_map(|line| {
        line.strip_prefix("content-length:")
            .and_then(|v| v.trim().parse::<usize>().ok())
    });
    let chunked = head.contains("transfer-encoding: chunked");
    loop {
        let body = &raw[head_end..];
        let complete = match length {
            Some(length) => body.len() >= length,
            None if chunked => body.ends_with(b"0\r\n\r\n"),
            None => false,
        };
        if complete {
            break;
        }
        let n = stream.read(&mut buffer).ok()?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buffer[..n]);
    }
    let body = String::from_utf8_lossy(&raw[head_end..]).into_owned();
    let body = if chunked { dechunk(&body)? } else { body };
    Some((status, body))
}

/// The body of a chunked response.
fn dechunk(mut rest: &str) -> Option<String> {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(body);
        }
        body.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// Value of an unlabelled sample in Prometheus text.
/// The value of the first sample of `name` in a Prometheus scrape, whatever its labels.
pub fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let (key, value) = line.rsplit_once(' ')?;
        let series = key.split('{').next()?;
        (series == name).then(|| value.trim().parse().ok())?
    })
}

/// `"schema"."table"` of one of the outbox's tables, for SQL in tests.
pub fn qualified(outbox: &TestOutbox, table: &Ident) -> String {
    format!("{}.{}", outbox.tables.schema().quoted(), table.quoted())
}

/// Ids of the rows of `table` (one of `outbox`'s) that match the SQL `condition`.
pub async fn ids_where(outbox: &TestOutbox, table: &Ident, condition: &str) -> Vec<Uuid> {
    sqlx::query_scalar(&format!(
        "SELECT id FROM {} WHERE {condition}",
        qualified(outbox, table)
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap()
}

pub async fn pending_ids(outbox: &TestOutbox) -> Vec<Uuid> {
    let events = outbox.tables.events();
    ids_where(outbox, events, "processed_at IS NULL AND dead_at IS NULL").await
}

/// Look with `probe` every `every` until it gives a value; `None` once `limit` has
/// passed without one.
pub async fn poll<T>(
    limit: Duration,
    every: Duration,
    mut probe: impl AsyncFnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe().await {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// Wait (at most `limit`, looking every 100 ms) for `condition`.
pub async fn wait_for(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let every = Duration::from_millis(100);
    let seen = poll(limit, every, async || condition().then_some(())).await;
    assert!(seen.is_some(), "no {what} within {limit:?}");
}

pub async fn wait_until_drained(outbox: &TestOutbox, limit: Duration) {
    let mut left = 0;
    let drained = poll(limit, Duration::from_millis(50), async || {
        left = pending_ids(outbox).await.len();
        (left == 0).then_some(())
    })
    .await;
    assert!(
        drained.is_some(),
        "outbox not drained in {limit:?}: {left} events pending"
    );
}

/// Enqueue `n` events on 50 aggregates in one transaction; their ids.
pub async fn enqueue(outbox: &TestOutbox, n: usize) -> Vec<Uuid> {
    let events: Vec<pgoutbox_core::NewEvent> = (0..n)
        .map(|i| pgoutbox_core::testing::event(&format!("{}", i % 50), i))
        .collect();
    let mut tx = outbox.pool.begin().await.unwrap();
    let ids = outbox.outbox.enqueue_many(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

/// Rows in the outbox's dead-letter view.
pub async fn dead_count(outbox: &TestOutbox) -> usize {
    let view = outbox.tables.dead_letters();
    ids_where(outbox, view, "true").await.len()
}

/// Drop `schema` (one the binary migrated) and everything in it.
pub async fn drop_schema(pool: &sqlx::PgPool, schema: &str) {
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(pool)
        .await
        .unwrap();
}

/// Drops a slot and a publication (of the test database) at the end of the test,
/// also when it fails (an abandoned slot keeps WAL on the server for ever).
pub struct DropSlot {
    pub slot: Ident,
    pub publication: Ident,
}

impl DropSlot {
    /// `name` as both the slot and its publication.
    pub fn named(name: &Ident) -> Self {
        Self {
            slot: name.clone(),
            publication: name.clone(),
        }
    }

    /// The names the binary gives the WAL outbox of `outbox` by default in the
    /// test database: its slot (`wal::slot::resolve`) and its publication
    /// (`pgoutbox_<schema>_<table>`).
    pub async fn defaults(outbox: &TestOutbox) -> Self {
        let mut conn = outbox.pool.acquire().await.unwrap();
        let slot = pgoutbox_postgres::wal::slot::resolve(&mut conn, &outbox.tables, None)
            .await
            .unwrap();
        Self {
            slot,
            publication: default_publication(outbox),
        }
    }
}

/// The binary's default publication of `outbox`'s WAL outbox.
pub fn default_publication(outbox: &TestOutbox) -> Ident {
    pgoutbox_postgres::wal::slot::default_publication(&outbox.tables).unwrap()
}

impl Drop for DropSlot {
    fn drop(&mut self) {
        pgoutbox_postgres::testing::drop_slot_when_released(
            self.slot.clone(),
            self.publication.clone(),
        );
    }
}

/// Each aggregate's event ids in the order of `events` (their insertion order).
pub fn runs_of(events: &[pgoutbox_core::NewEvent]) -> HashMap<String, Vec<Uuid>> {
    let mut runs: HashMap<String, Vec<Uuid>> = HashMap::new();
    for event in events {
        runs.entry(event.aggregate_id.clone())
            .or_default()
            .push(event.id);
    }
    runs
}

/// The broker's messages as (aggregate id, event id) in arrival order: every event
/// of `runs` once, and each aggregate's in insertion order.
pub fn assert_delivered(received: &[(String, Uuid)], runs: &HashMap<String, Vec<Uuid>>) {
    let total: usize = runs.values().map(Vec::len).sum();
    assert_eq!(received.len(), total, "messages received: {received:?}");
    for (aggregate, ids) in runs {
        let arrived: Vec<Uuid> = received
            .iter()
            .filter(|(a, _)| a == aggregate)
            .map(|(_, id)| *id)
            .collect();
        assert_eq!(&arrived, ids, "aggregate {aggregate}: arrival order");
    }
}
