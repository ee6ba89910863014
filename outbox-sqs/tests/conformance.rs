//! The shared publisher conformance suite against moto's SQS (a FIFO queue).

mod common;

use std::time::Duration;

use common::{create_queue, moto_addr, read, unique};
use pgoutbox_core::conformance::proxy::{closed_port, TcpProxy};
use pgoutbox_core::conformance::{
    self, BoxError, ConformanceTarget, OutageTarget, ReceivedMessage,
};
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::Event;
use pgoutbox_sqs::{SqsConfig, SqsPublisher};

struct Sqs {
    name: String,
    url: String,
    client: pgoutbox_sqs::aws_sdk_sqs::Client,
    /// In front of moto, for the outage checks.
    proxy: TcpProxy,
    /// The envelope of the publishers under test.
    envelope: Envelope,
}

impl Sqs {
    async fn new() -> Self {
        Self::with_envelope(Envelope::Outbox).await
    }

    /// A fresh queue, published to with `envelope`.
    async fn with_envelope(envelope: Envelope) -> Self {
        let name = unique("conformance", true);
        let client = common::publisher(&name).await.client().clone();
        let url = create_queue(&client, &name).await;
        Self {
            name,
            url,
            client,
            proxy: TcpProxy::start(moto_addr()).expect("proxy in front of moto"),
            envelope,
        }
    }

    /// Settings for this target's queue at `endpoint`, with short timeouts: for
    /// publishers meant to fail fast.
    fn short_config(&self, endpoint: &str) -> SqsConfig {
        SqsConfig::new(&self.name)
            .endpoint(endpoint)
            .region("us-east-1")
            .credentials("test", "test")
            .timeout(Duration::from_secs(3))
            .connect_timeout(Duration::from_secs(1))
    }
}

impl ConformanceTarget for Sqs {
    type Publisher = SqsPublisher;

    async fn publisher(&self) -> Result<SqsPublisher, BoxError> {
        // By name: exercises GetQueueUrl and its cache.
        Ok(common::config(&self.name)
            .envelope(self.envelope.clone())
            .build()
            .await?)
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<ReceivedMessage>, BoxError> {
        let mut out = Vec::new();
        for m in read(&self.client, &self.url, max, wait).await {
            let metadata = pgoutbox_sqs::metadata(&m)?;
            out.push(ReceivedMessage::new(
                metadata,
                m.body().unwrap_or_default().as_bytes(),
            )?);
        }
        Ok(out)
    }

    fn refused(&self, mut event: Event) -> Event {
        // Over SQS's 256 KiB: refused before sending.
        let big = "x".repeat(300 * 1024);
        event.payload = conformance::raw_json(&serde_json::json!({ "big": big }));
        event
    }

    async fn unreachable_publisher(&self) -> Result<SqsPublisher, BoxError> {
        Ok(self
            .short_config(&format!("http://127.0.0.1:{}", closed_port()))
            .max_attempts(2)
            .build()
            .await?)
    }
}

impl OutageTarget for Sqs {
    async fn outage_publisher(&self) -> Result<SqsPublisher, BoxError> {
        Ok(self
            .short_config(&format!("http://{}", self.proxy.addr()))
            .max_attempts(1)
            .build()
            .await?)
    }

    fn cut(&self) {
        self.proxy.cut();
    }

    fn restore(&self) {
        self.proxy.restore();
    }
}

pgoutbox_core::conformance_tests!(Sqs::new().await);
pgoutbox_postgres::relay_conformance_tests!(Sqs::new().await);
pgoutbox_core::conformance_tests!(@envelopes Sqs::with_envelope, |_| async {});
