//! PostgreSQL over TLS (feature `tls`), against the real server that
//! scripts/pg-tls.sh configures: a certificate signed by a test CA, and a role
//! `outbox_tls` that may log in only over TLS, with a password kept in a file.
#![cfg(feature = "tls")]

use pgoutbox_core::{Claim, NewEvent, Store};
use pgoutbox_postgres::testing::TestOutbox;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// What a test script exported.
fn env(name: &str) -> String {
    pgoutbox_core::testing::exported(name, "scripts/pg-tls.sh")
}

/// The TLS role's options with `params` appended to its URL, password from its file.
fn options(params: &str) -> PgConnectOptions {
    let password =
        std::fs::read_to_string(env("OUTBOX_PG_TLS_PASSWORD_FILE")).expect("password file");
    let url = format!(
        "postgres://{}@127.0.0.1:5432/test?{params}",
        env("OUTBOX_PG_TLS_USER")
    );
    url.parse::<PgConnectOptions>()
        .expect("valid URL")
        .password(password.trim_end())
}

/// The error of a login as the TLS role with `params`, which must fail: `what`
/// must be refused.
async fn login_error(params: &str, what: &str) -> String {
    let refused = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options(params))
        .await;
    match refused {
        Ok(_) => panic!("{what} must be refused"),
        Err(e) => e.to_string(),
    }
}

async fn encrypted(pool: &PgPool) -> (bool, Option<String>) {
    sqlx::query_as("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("pg_stat_ssl")
}

/// `sslmode=verify-full` with the CA in `sslrootcert`: the session is encrypted and
/// the outbox works through it (migrate, enqueue, claim).
#[tokio::test]
async fn verify_full_with_the_servers_ca_encrypts_and_the_outbox_works() {
    let ca = env("OUTBOX_TLS_CA");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options(&format!("sslmode=verify-full&sslrootcert={ca}")))
        .await
        .expect("TLS login with verify-full and the test CA");
    let (ssl, version) = encrypted(&pool).await;
    assert!(ssl, "session not encrypted");
    assert!(
        version.as_deref().is_some_and(|v| v.starts_with("TLSv1.")),
        "{version:?}"
    );

    let test = TestOutbox::with_pool(pool).await.expect("migrate over TLS");
    let event = NewEvent::new(
        "order",
        "1",
        "order.created",
        &serde_json::json!({"tls": true}),
    );
    test.enqueue_committed(std::slice::from_ref(&event))
        .await
        .expect("enqueue over TLS");
    let claim = test.store().claim(10).await.expect("claim over TLS");
    assert_eq!(
        claim.events().iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![event.id]
    );
    drop(claim);
    test.drop_schema().await.expect("drop schema");
}

/// `verify-full` checks the certificate: without the test CA (the system's roots
/// only) the server's certificate is refused, and no session starts.
#[tokio::test]
async fn verify_full_refuses_a_certificate_from_an_unknown_ca() {
    let text = login_error("sslmode=verify-full", "a certificate of an unknown CA").await;
    assert!(
        text.contains("certificate") || text.contains("UnknownIssuer"),
        "not a certificate error: {text}"
    );
}

/// The role may log in only over TLS: a plain session is refused by the server, so
/// the encrypted logins above did not fall back to plain text.
#[tokio::test]
async fn the_tls_role_cannot_log_in_without_tls() {
    let err = login_error("sslmode=disable", "a plain login").await;
    assert!(err.contains("no encryption"), "{err}");
}
