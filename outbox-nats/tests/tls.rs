//! NATS over TLS with nkey and password authentication, against a nats-server of
//! the test's own (`testing::TlsNatsServer`: a TLS listener with JetStream, started
//! per test on a free port) presenting the test CA's server certificate
//! (scripts/test-ca.sh).

use std::path::Path;
use std::time::Duration;

use pgoutbox_core::conformance::claimed_event;
use pgoutbox_core::{Outcome, Publisher};
use pgoutbox_nats::async_nats::jetstream::stream::StorageType;
use pgoutbox_nats::testing::{TlsNatsServer, PASSWORD, USER};
use pgoutbox_nats::{NatsConfig, SubjectRouting};

/// What a test script exported.
fn env(name: &str) -> String {
    pgoutbox_core::testing::exported(name, "scripts/test-ca.sh")
}

/// A TLS nats-server with the test CA's server certificate.
fn start_server() -> TlsNatsServer {
    TlsNatsServer::start(
        Path::new(&env("OUTBOX_TLS_SERVER_CERT")),
        Path::new(&env("OUTBOX_TLS_SERVER_KEY")),
    )
}

/// Settings for `server`, routed to a fresh prefix, with the test CA.
fn config(server: &TlsNatsServer, prefix: &str) -> NatsConfig {
    NatsConfig::new(server.url())
        .routing(SubjectRouting::new(prefix))
        .timeout(Duration::from_secs(5))
        .tls_ca_file(env("OUTBOX_TLS_CA"))
}

/// Connect with `config` (`how` says how it authenticates), publish one event into
/// a fresh stream named after `prefix` and expect the broker's acknowledgement.
async fn connects_and_publishes(config: NatsConfig, prefix: &str, how: &str) {
    let publisher = config
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect with TLS and {how}: {e}"));
    let mut stream = publisher.stream_config(&prefix.to_uppercase());
    stream.storage = StorageType::Memory;
    publisher
        .ensure_stream(stream)
        .await
        .expect("create stream over TLS");
    let event = claimed_event("conformance_order", "o-1", "conformance.created", 1);
    let outcomes = publisher.publish(std::slice::from_ref(&event)).await;
    assert!(
        matches!(outcomes.as_slice(), [Outcome::Published]),
        "{outcomes:?}"
    );
}

/// Connecting with `config` fails (`what` must be refused) with an error that
/// mentions `needle` (in any case).
async fn assert_refused(config: NatsConfig, what: &str, needle: &str) {
    let Err(e) = config.connect().await else {
        panic!("{what} must be refused");
    };
    assert!(e.to_string().to_lowercase().contains(needle), "{e}");
}

/// An nkey user over TLS (a `tls://` URL, the server's certificate checked against
/// the test CA) publishes into JetStream.
#[tokio::test(flavor = "multi_thread")]
async fn an_nkey_user_publishes_over_tls() {
    let server = start_server();
    let nkey = config(&server, "tls_nkey").nkey_seed_file(server.nkey_seed_file());
    connects_and_publishes(nkey, "tls_nkey", "an nkey").await;
}

/// The binary's way: settings from variables, the password read from a file.
#[tokio::test(flavor = "multi_thread")]
async fn a_password_from_a_file_authenticates_over_tls() {
    let server = start_server();
    let password_file = server.dir().join("password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).expect("password file");
    let vars = [
        ("OUTBOX_NATS_URL", server.url().to_string()),
        ("OUTBOX_NATS_SUBJECT_PREFIX", "tls_password".to_string()),
        ("OUTBOX_NATS_TLS_REQUIRED", "true".to_string()),
        ("OUTBOX_NATS_TLS_CA", env("OUTBOX_TLS_CA")),
        ("OUTBOX_NATS_USER", USER.to_string()),
        (
            "OUTBOX_NATS_PASSWORD_FILE",
            password_file.display().to_string(),
        ),
    ]
    .map(|(k, v)| (k.to_string(), v));
    let from_vars = NatsConfig::from_vars(vars).expect("valid settings");
    connects_and_publishes(from_vars, "tls_password", "a password from a file").await;
}

/// Without the test CA the server's certificate is not trusted; a wrong seed is
/// refused by the server; a missing file is a configuration error naming it.
#[tokio::test(flavor = "multi_thread")]
async fn untrusted_certificates_wrong_keys_and_missing_files_are_refused() {
    let server = start_server();
    let untrusted = NatsConfig::new(server.url())
        .timeout(Duration::from_secs(5))
        .nkey_seed_file(server.nkey_seed_file());
    assert_refused(untrusted, "a certificate of an unknown CA", "certificate").await;

    let other = server.dir().join("other.nk");
    let seed = nkeys::KeyPair::new_user().seed().expect("seed");
    std::fs::write(&other, seed).expect("seed file");
    let wrong = config(&server, "tls_wrong").nkey_seed_file(&other);
    assert_refused(wrong, "an unknown nkey", "authorization").await;

    let missing = Path::new("/nonexistent/ca.pem");
    let err = config(&server, "tls_missing")
        .tls_ca_file(missing)
        .validate()
        .expect_err("a missing CA file is an error");
    assert!(
        err.to_string().contains("tls_ca_file") && err.to_string().contains("/nonexistent/ca.pem"),
        "{err}"
    );
}
