//! The relay reports the documented metrics through the `metrics` facade.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use pgoutbox_core::testing::{MemoryStore, RecordingPublisher};
use pgoutbox_core::{telemetry, NewEvent, PublishError, Relay};

#[tokio::test(flavor = "current_thread")]
async fn relay_reports_published_failed_dead_claim_and_batch_duration() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Thread-local recorder: the current-thread runtime runs the relay on this thread.
    let _guard = metrics::set_default_local_recorder(&recorder);

    let store = MemoryStore::new();
    for (n, event_type) in [
        "order.created",
        "order.created",
        "order.flaky",
        "order.poison",
    ]
    .iter()
    .enumerate()
    {
        store
            .enqueue(NewEvent::new(
                "order",
                n.to_string(),
                *event_type,
                &serde_json::json!({}),
            ))
            .unwrap();
    }
    let publisher = RecordingPublisher::failing_when(|e| match e.event_type.as_str() {
        "order.flaky" => Some(PublishError::retryable("timeout")),
        "order.poison" => Some(PublishError::permanent("too large")),
        _ => None,
    });
    Relay::new(store, publisher).run_once().await.unwrap();

    let metrics: Vec<_> = snapshotter.snapshot().into_vec();
    let value = |kind: MetricKind, name: &str, label: Option<&str>| {
        metrics
            .iter()
            .find(|(key, _, _, _)| {
                key.kind() == kind
                    && key.key().name() == name
                    && label.is_none_or(|l| key.key().labels().any(|x| x.value() == l))
            })
            .map(|(_, _, _, v)| v)
    };
    assert_eq!(
        value(MetricKind::Counter, telemetry::EVENTS_PUBLISHED, None),
        Some(&DebugValue::Counter(2))
    );
    assert_eq!(
        value(
            MetricKind::Counter,
            telemetry::EVENTS_FAILED,
            Some("order.flaky")
        ),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        value(
            MetricKind::Counter,
            telemetry::EVENTS_FAILED,
            Some("order.poison")
        ),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        value(
            MetricKind::Counter,
            telemetry::EVENTS_DEAD_LETTERED,
            Some("order.poison")
        ),
        Some(&DebugValue::Counter(1))
    );
    match value(MetricKind::Histogram, telemetry::CLAIM_DURATION, None) {
        Some(DebugValue::Histogram(samples)) => assert_eq!(samples.len(), 1),
        other => panic!("no claim duration histogram: {other:?}"),
    }
    match value(MetricKind::Histogram, telemetry::BATCH_DURATION, None) {
        Some(DebugValue::Histogram(samples)) => assert_eq!(samples.len(), 1),
        other => panic!("no batch duration histogram: {other:?}"),
    }
    match value(MetricKind::Histogram, telemetry::PUBLISH_LAG, None) {
        Some(DebugValue::Histogram(samples)) => assert_eq!(samples.len(), 2),
        other => panic!("no publish lag histogram: {other:?}"),
    }
}

/// Two relays in one process (two outboxes) keep separate series: every metric
/// carries the `outbox` label, the store's name unless the relay is given one.
#[tokio::test(flavor = "current_thread")]
async fn every_series_carries_the_outbox_label_of_its_relay() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);

    let relay_for = |events: usize| {
        let store = MemoryStore::new();
        for n in 0..events {
            store
                .enqueue(NewEvent::new(
                    "order",
                    n.to_string(),
                    "order.created",
                    &serde_json::json!({}),
                ))
                .unwrap();
        }
        Relay::new(store, RecordingPublisher::new())
    };
    let default_named = relay_for(1);
    assert_eq!(default_named.name(), "outbox");
    default_named.run_once().await.unwrap();
    let tenant_a = relay_for(2).with_name("tenant_a.outbox_events");
    tenant_a.run_once().await.unwrap();
    let tenant_b = relay_for(3).with_name("tenant_b.outbox_events");
    tenant_b.run_once().await.unwrap();

    let metrics: Vec<_> = snapshotter.snapshot().into_vec();
    for (key, _, _, _) in &metrics {
        assert!(
            key.key().labels().any(|l| l.key() == "outbox"),
            "{} has no outbox label",
            key.key().name()
        );
    }
    let published = |outbox: &str| {
        metrics
            .iter()
            .find(|(key, _, _, _)| {
                key.kind() == MetricKind::Counter
                    && key.key().name() == telemetry::EVENTS_PUBLISHED
                    && key
                        .key()
                        .labels()
                        .any(|l| l.key() == "outbox" && l.value() == outbox)
            })
            .map(|(_, _, _, v)| v)
    };
    assert_eq!(published("outbox"), Some(&DebugValue::Counter(1)));
    assert_eq!(
        published("tenant_a.outbox_events"),
        Some(&DebugValue::Counter(2))
    );
    assert_eq!(
        published("tenant_b.outbox_events"),
        Some(&DebugValue::Counter(3))
    );
}
