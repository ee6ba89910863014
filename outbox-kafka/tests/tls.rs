//! TLS and SASL settings with the `ssl` feature (librdkafka linked against OpenSSL).
//!
//! librdkafka's mock cluster has no TLS or SASL listener and no Kafka broker with
//! one runs here, so this checks what the feature changes on the client side: a
//! build without it refuses `security.protocol = SASL_SSL` ("OpenSSL not available
//! at build time") and SCRAM ("No provider for SASL mechanism"); with it the
//! publisher is created from the settings the `outbox` binary passes, the SASL
//! password read from a file.
#![cfg(feature = "ssl")]

use pgoutbox_kafka::{KafkaConfig, ENV_BROKERS, ENV_SASL_PASSWORD_FILE};

#[test]
fn sasl_ssl_with_scram_a_ca_file_and_a_password_file_is_accepted() {
    let ca = std::env::var("OUTBOX_TLS_CA").unwrap_or_else(|_| {
        panic!("OUTBOX_TLS_CA is not set: run the tests with scripts/test.sh, which sources scripts/test-ca.sh")
    });
    let dir = std::env::temp_dir().join(format!("outbox-kafka-tls-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let password_file = dir.join("password");
    std::fs::write(&password_file, "s3cret\n").expect("password file");
    let vars = [
        (ENV_BROKERS, "127.0.0.1:9".to_string()),
        (
            "OUTBOX_KAFKA_RDKAFKA_SECURITY_PROTOCOL",
            "SASL_SSL".to_string(),
        ),
        (
            "OUTBOX_KAFKA_RDKAFKA_SASL_MECHANISMS",
            "SCRAM-SHA-512".to_string(),
        ),
        ("OUTBOX_KAFKA_RDKAFKA_SASL_USERNAME", "outbox".to_string()),
        ("OUTBOX_KAFKA_RDKAFKA_SSL_CA_LOCATION", ca),
        (ENV_SASL_PASSWORD_FILE, password_file.display().to_string()),
    ]
    .map(|(k, v)| (k.to_string(), v));
    let config = KafkaConfig::from_vars(vars).expect("valid settings");
    let client = config.client_config().expect("client config");
    assert_eq!(client.get("sasl.password"), Some("s3cret"));
    config
        .build()
        .expect("librdkafka accepts SASL_SSL with SCRAM and a CA file");

    std::fs::write(&password_file, "\n").expect("empty password file");
    let err = KafkaConfig::from_vars([
        (ENV_BROKERS.to_string(), "127.0.0.1:9".to_string()),
        (
            ENV_SASL_PASSWORD_FILE.to_string(),
            password_file.display().to_string(),
        ),
    ])
    .expect_err("an empty password file is refused");
    assert!(err.to_string().contains("is empty"), "{err}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}
