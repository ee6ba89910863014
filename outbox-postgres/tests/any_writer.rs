//! Writers without the Rust crate (docs/sql-contract.md), against the real
//! PostgreSQL: the seed's own producer statement and pending count run unchanged
//! against a migrated outbox, and what plain SQL writes is published intact.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::HashMap;
use std::sync::Arc;

use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::Relay;
use pgoutbox_postgres::testing::TestOutbox;
use uuid::Uuid;

/// The seed's producer (`InsertOutboxEvent`), as its readers run it, with the
/// table name of `outbox`.
fn seed_insert(outbox: &TestOutbox) -> String {
    format!(
        "INSERT INTO {}.outbox_events (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, $2, $3, $4)",
        outbox.tables.schema().quoted()
    )
}

/// Publish everything due with an in-process relay; what it published.
async fn relay_all(outbox: &TestOutbox) -> Vec<pgoutbox_core::Event> {
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(outbox.store(), Arc::clone(&publisher));
    for _ in 0..100 {
        if relay.run_once().await.unwrap().claimed == 0 {
            break;
        }
    }
    publisher.published()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_seed_producer_statement_and_pending_count_run_unchanged() {
    let outbox = TestOutbox::new().await.unwrap();
    let insert = seed_insert(&outbox);
    // One transaction per event, as the seed's producer writes them (with its
    // business row); aggregates interleaved.
    let mut written: HashMap<String, Vec<String>> = HashMap::new();
    for n in 0..30 {
        let aggregate = format!("order-{}", n % 3);
        let payload = format!(r#"{{"order": "{aggregate}", "n": {n}, "note": "é \"x\""}}"#);
        let mut tx = outbox.pool.begin().await.unwrap();
        sqlx::query(&insert)
            .bind("order")
            .bind(&aggregate)
            .bind("order.created")
            // sqlx sends typed parameters (a Rust string is `text`), so JSON goes as
            // a JSON value; drivers sending untyped ones (lib/pq, psycopg) pass text.
            .bind(serde_json::from_str::<serde_json::Value>(&payload).unwrap())
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        written.entry(aggregate).or_default().push(payload);
    }
    // The seed's pending count (`OutboxPendingCount`).
    let pending: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {}.outbox_events WHERE processed_at IS NULL",
        outbox.tables.schema().quoted()
    ))
    .fetch_one(&outbox.pool)
    .await
    .unwrap();
    assert_eq!(pending, 30);
    let ids: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT id FROM {}.outbox_events ORDER BY seq",
        outbox.tables.schema().quoted()
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap();

    let published = relay_all(&outbox).await;
    assert_eq!(
        published.iter().map(|e| e.id).collect::<Vec<_>>(),
        ids,
        "each event once, with the id the table gave it, in insertion order"
    );
    for aggregate in written.keys() {
        let payloads: Vec<String> = published
            .iter()
            .filter(|e| &e.aggregate_id == aggregate)
            .map(|e| e.payload.get().to_owned())
            .collect();
        // jsonb stores the payload normalised: the same JSON value, in jsonb's text.
        let values = |texts: &[String]| -> Vec<serde_json::Value> {
            texts
                .iter()
                .map(|t| serde_json::from_str(t).unwrap())
                .collect()
        };
        assert_eq!(
            values(&payloads),
            values(&written[aggregate]),
            "aggregate {aggregate}"
        );
    }
    assert!(published.iter().all(|e| e.event_type == "order.created"
        && e.aggregate_type == "order"
        && e.headers.is_empty()));
    outbox.drop_schema().await.unwrap();
}

/// The optional columns of the contract: headers (trace context), destination,
/// delayed delivery, a producer's own id; and headers the relay could not read
/// are refused at the INSERT, naming the constraint.
#[tokio::test(flavor = "multi_thread")]
async fn plain_sql_sets_headers_destination_delay_and_id() {
    let outbox = TestOutbox::new().await.unwrap();
    let table = format!("{}.outbox_events", outbox.tables.schema().quoted());
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let own_id = Uuid::new_v4();
    sqlx::query(&format!(
        "INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload, headers, destination) \
         VALUES ($1, 'order', '1', 'order.paid', '{{\"total\": 10}}', \
         jsonb_build_object('traceparent', $2::text, 'tenant', 'acme'), 'payments.special')"
    ))
    .bind(own_id)
    .bind(traceparent)
    .execute(&outbox.pool)
    .await
    .unwrap();
    let delayed: Uuid = sqlx::query_scalar(&format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, available_at) \
         VALUES ('order', '2', 'order.reminder', '{{}}', now() + interval '1 hour') RETURNING id"
    ))
    .fetch_one(&outbox.pool)
    .await
    .unwrap();
    for (headers, what) in [
        (r#"{"n": 1}"#, "a number"),
        ("[]", "an array"),
        (r#"{"": "x"}"#, "an empty name"),
    ] {
        let err = sqlx::query(&format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ('order', '3', 'order.paid', '{{}}', $1::jsonb)"
        ))
        .bind(headers)
        .execute(&outbox.pool)
        .await
        .unwrap_err();
        let message = err.as_database_error().unwrap().message().to_owned();
        assert!(
            message.contains("outbox_events_headers_check"),
            "headers with {what}: {message}"
        );
    }

    let published = relay_all(&outbox).await;
    assert_eq!(published.len(), 1, "the delayed event waits");
    let event = &published[0];
    assert_eq!(event.id, own_id);
    assert_eq!(event.traceparent(), Some(traceparent));
    assert_eq!(
        event.headers.get("tenant").map(String::as_str),
        Some("acme")
    );
    assert_eq!(event.destination.as_deref(), Some("payments.special"));
    let waiting: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT id FROM {table} WHERE processed_at IS NULL"
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap();
    assert_eq!(waiting, [delayed]);
    outbox.drop_schema().await.unwrap();
}
