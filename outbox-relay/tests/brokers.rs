//! The `outbox` binary publishing to each real broker (NATS has its own tests in
//! `binary.rs`): RabbitMQ, Kafka (tansu, `OUTBOX_TANSU_BROKERS`) and SQS (moto,
//! `OUTBOX_SQS_ENDPOINT`), configured by the file's `[broker.<kind>]` section as an
//! operator writes it. Every event arrives once, each aggregate's in insertion order,
//! read back with the adapter's consumer helper. RabbitMQ runs with the CloudEvents
//! envelope in structured mode, SQS in binary mode (`[envelope]`), the others with
//! the default outbox envelope.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{
    assert_delivered, command, dead_count, runs_of, wait_until_drained, Config, RelayProcess,
};
#[allow(unused_imports)] // not every broker feature is compiled in every build
use pgoutbox_core::envelope::Format;
use pgoutbox_core::testing::event;
use pgoutbox_core::NewEvent;
use pgoutbox_postgres::testing::TestOutbox;
use uuid::Uuid;

/// Aggregates and events per aggregate the tests enqueue.
const AGGREGATES: usize = 6;
const PER_AGGREGATE: usize = 10;

/// What a test script exported.
#[allow(dead_code)] // not every broker feature is compiled in every build
fn env(name: &str) -> String {
    pgoutbox_core::testing::exported(name, "scripts/moto.sh or scripts/tansu.sh")
}

/// `AGGREGATES x PER_AGGREGATE` events committed in one transaction, interleaved
/// across aggregates; returns each aggregate's ids in insertion order.
async fn enqueue(outbox: &TestOutbox) -> HashMap<String, Vec<Uuid>> {
    let events: Vec<NewEvent> = (0..AGGREGATES * PER_AGGREGATE)
        .map(|i| event(&format!("o-{}", i % AGGREGATES), i))
        .collect();
    outbox.enqueue_committed(&events).await.unwrap();
    runs_of(&events)
}

/// Enqueue the test's events in a fresh outbox, run the binary with `broker`
/// appended to a test config until the outbox is drained, then stop it with
/// SIGTERM: it must exit cleanly with no dead letter. Returns the outbox and each
/// aggregate's ids in insertion order.
async fn publish_through_binary(
    broker: &str,
    env: &[(&str, &str)],
) -> (TestOutbox, HashMap<String, Vec<Uuid>>) {
    let outbox = TestOutbox::new().await.unwrap();
    let runs = enqueue(&outbox).await;
    let config = Config::with_broker(outbox.tables.schema().as_str(), "0", broker);
    let mut cmd = command(&config.path, &["relay"]);
    for (name, value) in env {
        cmd.env(name, value);
    }
    let relay = RelayProcess::spawn(cmd);
    let log = relay.log();
    wait_until_drained(&outbox, Duration::from_secs(60)).await;
    let (status, _) = relay.terminate(Duration::from_secs(25));
    assert!(status.success(), "{}", log.lines().join("\n"));
    assert_eq!(dead_count(&outbox).await, 0, "{}", log.lines().join("\n"));
    (outbox, runs)
}

/// Read (aggregate id, event id) pairs with `read_some` until as many arrived as
/// the tests enqueue (at most 60 s), then check them against `runs`.
#[allow(dead_code)] // not every broker feature is compiled in every build
async fn assert_read_back(
    runs: &HashMap<String, Vec<Uuid>>,
    mut read_some: impl AsyncFnMut() -> Vec<(String, Uuid)>,
) {
    let total = AGGREGATES * PER_AGGREGATE;
    let mut received = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while received.len() < total {
        assert!(
            std::time::Instant::now() < deadline,
            "only {} of {total} messages read back",
            received.len()
        );
        received.extend(read_some().await);
    }
    assert_delivered(&received, runs);
}

#[cfg(feature = "amqp")]
#[tokio::test(flavor = "multi_thread")]
async fn relay_publishes_to_rabbitmq() {
    use pgoutbox_amqp::lapin::options::{
        BasicAckOptions, BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions,
        QueueDeclareOptions,
    };
    use pgoutbox_amqp::lapin::types::FieldTable;
    use pgoutbox_amqp::lapin::{Connection, ConnectionProperties, ExchangeKind};

    let url = env("OUTBOX_AMQP_URL");
    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    let exchange = format!("relaytest_{tag}");
    // The operator declares the exchange and binds the consumers' queues.
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let auto_delete = ExchangeDeclareOptions {
        auto_delete: true,
        ..ExchangeDeclareOptions::default()
    };
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .exchange_declare(
            &exchange,
            ExchangeKind::Topic,
            auto_delete,
            FieldTable::default(),
        )
        .await
        .unwrap();
    let queue = channel
        .queue_declare("", exclusive, FieldTable::default())
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.name().as_str(),
            &exchange,
            "#",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let (outbox, runs) = publish_through_binary(
        &format!("[broker]\nkind = \"amqp\"\n[broker.amqp]\nurl = \"{url}\"\nexchange = \"{exchange}\"\n\
                  [envelope]\nformat = \"cloudevents-structured\"\nsource = \"/relay-test\"\n"),
        &[],
    )
    .await;

    let mut received = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.name().as_str(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        let metadata = pgoutbox_amqp::metadata(&message.delivery).unwrap();
        assert_eq!(metadata.format, Format::CloudEventsStructured);
        assert_eq!(metadata.source.as_deref(), Some("/relay-test"));
        assert_eq!(metadata.subject.as_ref(), Some(&metadata.aggregate_id));
        let body: serde_json::Value = metadata.decode(&message.delivery.data).unwrap();
        assert!(body["n"].is_u64(), "{body}");
        received.push((metadata.aggregate_id.clone(), metadata.event_id));
        message
            .delivery
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
    }
    assert_delivered(&received, &runs);
    connection.close(0, "done").await.unwrap();
    outbox.drop_schema().await.unwrap();
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread")]
async fn relay_publishes_to_kafka_on_tansu() {
    use pgoutbox_kafka::rdkafka::config::ClientConfig;
    use pgoutbox_kafka::rdkafka::consumer::{Consumer, StreamConsumer};

    let brokers = env("OUTBOX_TANSU_BROKERS");
    let topic = format!("relaytest-{}", &Uuid::new_v4().simple().to_string()[..12]);
    // tansu, like most managed clusters, creates no topic on first use: the binary
    // creates it at start (`create_topics_with_partitions`); 0 partitions is refused.
    let section = format!(
        "[broker]\nkind = \"kafka\"\n[broker.kafka]\nbrokers = \"{brokers}\"\ntopic = \"{topic}\"\n"
    );
    let zero = Config::new(&format!("{section}create_topics_with_partitions = 0\n"));
    let refused = command(&zero.path, &["relay"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("create_topics_with_partitions = 0: expected at least 1"),
        "{stderr}"
    );

    let (outbox, runs) = publish_through_binary(
        &format!("{section}create_topics_with_partitions = 3\n"),
        &[],
    )
    .await;

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("{topic}-reader"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[&topic]).unwrap();
    assert_read_back(&runs, async || {
        let Ok(Ok(message)) = tokio::time::timeout(Duration::from_secs(1), consumer.recv()).await
        else {
            return Vec::new();
        };
        let metadata = pgoutbox_kafka::metadata(&message).unwrap();
        vec![(metadata.aggregate_id, metadata.event_id)]
    })
    .await;
    outbox.drop_schema().await.unwrap();
}

#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread")]
async fn relay_publishes_to_sqs_on_moto() {
    use pgoutbox_sqs::aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
    use pgoutbox_sqs::SqsConfig;

    let endpoint = env("OUTBOX_SQS_ENDPOINT");
    let queue = format!(
        "relaytest-{}.fifo",
        &Uuid::new_v4().simple().to_string()[..12]
    );
    // The operator creates the FIFO queue.
    let admin = SqsConfig::new(&queue)
        .endpoint(&endpoint)
        .region("us-east-1")
        .credentials("test", "test")
        .build()
        .await
        .unwrap();
    let client = admin.client().clone();
    let queue_url = client
        .create_queue()
        .queue_name(&queue)
        .attributes(QueueAttributeName::FifoQueue, "true")
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string();

    let (outbox, runs) = publish_through_binary(
        &format!(
            "[broker]\nkind = \"sqs\"\n[broker.sqs]\nqueue = \"{queue}\"\nendpoint = \"{endpoint}\"\nregion = \"us-east-1\"\n"
        ),
        // Credentials come from the AWS SDK's usual chain; moto accepts any. The
        // envelope from the environment, as a deployment would set it.
        &[
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("OUTBOX_ENVELOPE", "cloudevents-binary"),
            ("OUTBOX_CLOUDEVENTS_SOURCE", "urn:relay-test"),
            ("OUTBOX_CLOUDEVENTS_SUBJECT", "{aggregate_type}/{aggregate_id}"),
        ],
    )
    .await;

    assert_read_back(&runs, async || {
        let mut received = Vec::new();
        let got = client
            .receive_message()
            .queue_url(&queue_url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .unwrap();
        for message in got.messages() {
            let metadata = pgoutbox_sqs::metadata(message).unwrap();
            assert_eq!(metadata.format, Format::CloudEventsBinary);
            assert_eq!(metadata.source.as_deref(), Some("urn:relay-test"));
            assert_eq!(
                metadata.subject,
                Some(format!("order/{}", metadata.aggregate_id))
            );
            received.push((metadata.aggregate_id.clone(), metadata.event_id));
            client
                .delete_message()
                .queue_url(&queue_url)
                .receipt_handle(message.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
        }
        received
    })
    .await;
    client
        .delete_queue()
        .queue_url(&queue_url)
        .send()
        .await
        .unwrap();
    outbox.drop_schema().await.unwrap();
}
