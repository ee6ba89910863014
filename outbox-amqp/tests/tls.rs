//! RabbitMQ over TLS (`amqps://`): the local broker's TLS listener on 127.0.0.1:5671,
//! set up by scripts/rabbitmq-tls.sh with the test CA's server certificate.

mod common;

use std::time::Duration;

use common::AmqpTarget;
use pgoutbox_amqp::AmqpConfig;
use pgoutbox_core::conformance::claimed_event;
use pgoutbox_core::{Outcome, Publisher};

/// What a test script exported.
fn env(name: &str) -> String {
    pgoutbox_core::testing::exported(name, "scripts/rabbitmq-tls.sh")
}

/// With the test CA, a publisher reaches the broker over TLS, the password read from
/// a file (replacing the URL's), and its message arrives in the target's queue.
#[tokio::test(flavor = "multi_thread")]
async fn a_publisher_over_tls_with_a_password_file_delivers() {
    let target = AmqpTarget::new().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let password_file = dir.path().join("password");
    std::fs::write(&password_file, "guest\n").expect("password file");
    let url = env("OUTBOX_AMQPS_URL").replace("guest:guest@", "guest:wrong@");
    let vars = [
        ("OUTBOX_AMQP_URL", url),
        ("OUTBOX_AMQP_TLS_CA", env("OUTBOX_TLS_CA")),
        (
            "OUTBOX_AMQP_PASSWORD_FILE",
            password_file.display().to_string(),
        ),
        ("OUTBOX_AMQP_TIMEOUT_MS", "5000".to_string()),
    ]
    .map(|(k, v)| (k.to_string(), v));
    let config = AmqpConfig::from_vars(vars)
        .expect("valid settings")
        .routing(target.config("unused").routing);
    let publisher = config.connect().await.expect("connect over TLS");
    let sent = claimed_event("conformance_order", "o-1", "conformance.created", 1);
    let outcomes = publisher.publish(std::slice::from_ref(&sent)).await;
    assert!(
        matches!(outcomes.as_slice(), [Outcome::Published]),
        "{outcomes:?}"
    );
    let got = target.get(1, Duration::from_secs(10)).await;
    assert_eq!(
        got.iter()
            .map(|(meta, _)| meta.event_id)
            .collect::<Vec<_>>(),
        vec![sent.id]
    );
    target.delete().await;
}

/// Without the test CA (the system's roots only) the broker's certificate is not
/// trusted, and no connection is made.
#[tokio::test(flavor = "multi_thread")]
async fn an_untrusted_broker_certificate_is_refused() {
    let err = AmqpConfig::new(env("OUTBOX_AMQPS_URL"))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect_err("a certificate of an unknown CA must be refused");
    let text = err.to_string().to_lowercase();
    assert!(
        text.contains("certificate") || text.contains("unknownissuer"),
        "{err}"
    );
}
