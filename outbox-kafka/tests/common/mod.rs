//! Test helpers: librdkafka's mock cluster on its own thread, and a reader.
#![allow(dead_code, unreachable_pub)]

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pgoutbox_kafka::rdkafka::config::ClientConfig;
use pgoutbox_kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use pgoutbox_kafka::rdkafka::message::{Message, OwnedMessage};
use pgoutbox_kafka::rdkafka::mocking::MockCluster;
use pgoutbox_kafka::rdkafka::{Offset, TopicPartitionList};

type Reply = mpsc::SyncSender<Result<(), String>>;

enum Command {
    CreateTopic(String, i32, Reply),
    BrokerDown(i32, Reply),
    BrokerUp(i32, Reply),
}

/// A mock Kafka cluster (librdkafka's, speaking the Kafka protocol on a local TCP
/// port). The cluster handle is not `Send`, so it lives on a thread of its own.
pub struct MockKafka {
    bootstrap: String,
    commands: Option<mpsc::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
}

impl MockKafka {
    pub fn start(brokers: i32) -> Self {
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (commands, rx) = mpsc::channel::<Command>();
        let thread = std::thread::spawn(move || {
            let cluster = match MockCluster::new(brokers) {
                Ok(c) => c,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(cluster.bootstrap_servers()));
            for command in rx {
                let (result, reply) = match command {
                    Command::CreateTopic(t, n, reply) => (cluster.create_topic(&t, n, 1), reply),
                    Command::BrokerDown(id, reply) => (cluster.broker_down(id), reply),
                    Command::BrokerUp(id, reply) => (cluster.broker_up(id), reply),
                };
                let _ = reply.send(result.map_err(|e| e.to_string()));
            }
        });
        let bootstrap = ready_rx
            .recv()
            .expect("mock cluster thread died")
            .expect("cannot start librdkafka's mock cluster");
        Self {
            bootstrap,
            commands: Some(commands),
            thread: Some(thread),
        }
    }

    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    fn call(&self, make: impl FnOnce(Reply) -> Command) {
        let (tx, rx) = mpsc::sync_channel(1);
        self.commands
            .as_ref()
            .expect("mock cluster stopped")
            .send(make(tx))
            .expect("mock cluster thread died");
        rx.recv()
            .expect("mock cluster thread died")
            .expect("mock cluster command failed");
    }

    /// A cluster of `brokers` with a topic of `partitions` named
    /// [`unique`]`(prefix)`; the cluster and the topic's name.
    pub fn with_topic(brokers: i32, prefix: &str, partitions: i32) -> (Self, String) {
        let mock = Self::start(brokers);
        let topic = unique(prefix);
        mock.create_topic(&topic, partitions);
        (mock, topic)
    }

    pub fn create_topic(&self, topic: &str, partitions: i32) {
        self.call(|r| Command::CreateTopic(topic.to_string(), partitions, r));
    }

    pub fn broker_down(&self, id: i32) {
        self.call(|r| Command::BrokerDown(id, r));
    }

    pub fn broker_up(&self, id: i32) {
        self.call(|r| Command::BrokerUp(id, r));
    }
}

impl Drop for MockKafka {
    fn drop(&mut self) {
        self.commands.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A unique topic name per test.
pub use pgoutbox_core::testing::unique;

/// A consumer reading `topic` (partitions `0..partitions`) from the beginning.
pub fn consumer(bootstrap: &str, topic: &str, partitions: i32) -> StreamConsumer {
    let consumer = fresh_group_member(bootstrap);
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions {
        assignment
            .add_partition_offset(topic, p, Offset::Beginning)
            .expect("assignment");
    }
    consumer.assign(&assignment).expect("assign");
    consumer
}

/// A consumer in a fresh consumer group, subscribed to `topic` from the beginning:
/// partitions come from the broker's group coordinator.
pub fn group_consumer(bootstrap: &str, topic: &str) -> StreamConsumer {
    let consumer = fresh_group_member(bootstrap);
    consumer.subscribe(&[topic]).expect("subscribe");
    consumer
}

/// A consumer of a fresh group that starts from the earliest offset, commits nothing.
fn fresh_group_member(bootstrap: &str) -> StreamConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("outbox-test"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer")
}

/// Read up to `max` messages, waiting at most `wait` in all.
pub async fn read(consumer: &StreamConsumer, max: usize, wait: Duration) -> Vec<OwnedMessage> {
    let deadline = Instant::now() + wait;
    let mut out = Vec::new();
    while out.len() < max {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, consumer.recv()).await {
            Ok(Ok(m)) => out.push(m.detach()),
            Ok(Err(e)) => eprintln!("consumer error (ignored): {e}"),
            Err(_) => break,
        }
    }
    out
}

/// The partition and key of a message, for assertions.
pub fn key(m: &OwnedMessage) -> String {
    String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned()
}

/// The tansu broker scripts/tansu.sh started (a real Kafka-protocol broker process,
/// in-memory storage): its bootstrap address, from `OUTBOX_TANSU_BROKERS`.
pub fn tansu_bootstrap() -> String {
    std::env::var("OUTBOX_TANSU_BROKERS").unwrap_or_else(|_| {
        panic!("OUTBOX_TANSU_BROKERS is not set: run the tests with scripts/test.sh, which starts tansu")
    })
}

/// Create `topic` with `partitions` on the broker at `bootstrap` (the Kafka admin
/// API, as on any broker) and wait until its metadata shows every partition.
pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) {
    use pgoutbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use pgoutbox_kafka::rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topics");
    for result in results {
        result.unwrap_or_else(|(name, code)| panic!("cannot create topic {name}: {code}"));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let metadata = admin
            .inner()
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .expect("metadata");
        let ready = metadata
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.partitions().len() == partitions as usize);
        if ready {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "topic {topic} never showed {partitions} partitions"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
