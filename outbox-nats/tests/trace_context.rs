//! OpenTelemetry trace context from the producer's span, through PostgreSQL and the
//! relay's batch span, to the consumer's span on the real NATS JetStream; spans are
//! collected by the SDK's in-memory exporter.

mod common;

use std::time::{Duration, Instant};

use common::{nats_url, NatsTarget};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::Value;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use pgoutbox_core::{trace_context, NewEvent, Relay, TRACEPARENT};
use pgoutbox_postgres::testing::TestOutbox;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

fn attribute(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

// Current-thread runtime: the subscriber set as this thread's default sees every span.
#[tokio::test]
async fn a_consumer_continues_the_trace_of_the_span_that_enqueued_the_event() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-test")));
    let _default = tracing::subscriber::set_default(subscriber);

    let test = TestOutbox::new().await.expect("PostgreSQL at DATABASE_URL");
    let target = NatsTarget::new().await;
    let publisher = target.config(&nats_url()).connect().await.expect("connect");
    let relay = Relay::new(test.store(), publisher);

    // Producer: the event enqueued inside `place_order` carries its context; one
    // enqueued outside any span carries none.
    let order_span = tracing::info_span!("place_order");
    let order = order_span.context().span().span_context().clone();
    assert!(order.is_valid(), "the OpenTelemetry layer records spans");
    let traced = NewEvent::new("order", "o-1", "order.created", &serde_json::json!({}));
    test.enqueue_committed(std::slice::from_ref(&traced))
        .instrument(order_span.clone())
        .await
        .expect("enqueue");
    drop(order_span);
    let untraced = NewEvent::new("order", "o-2", "order.created", &serde_json::json!({}));
    test.enqueue_committed(std::slice::from_ref(&untraced))
        .await
        .expect("enqueue");

    // Relay: one batch publishes both.
    let report = relay.run_once().await.expect("relay");
    assert_eq!(report.published, 2, "{report:?}");

    // Consumer: read both back; the traced one's headers carry the producer's trace.
    let mut received = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while received.len() < 2 {
        assert!(Instant::now() < deadline, "messages did not arrive");
        received.extend(target.fetch(2, Duration::from_millis(500)).await);
    }
    let message = received
        .iter()
        .find(|m| m.id() == traced.id)
        .expect("the traced event");
    let traceparent = message
        .metadata
        .headers
        .get(TRACEPARENT)
        .expect("traceparent header");
    assert!(
        traceparent.contains(&order.trace_id().to_string()),
        "{traceparent} is not of trace {}",
        order.trace_id()
    );
    let other = received
        .iter()
        .find(|m| m.id() == untraced.id)
        .expect("the untraced event");
    assert!(
        !other.metadata.headers.contains_key(TRACEPARENT),
        "an event enqueued outside any span got a trace: {:?}",
        other.metadata.headers
    );
    let handle = tracing::info_span!("handle_order_created");
    trace_context::follow(&handle, &message.metadata.headers);
    handle.in_scope(|| tracing::info!("handled"));
    drop(handle);

    provider.force_flush().expect("flush");
    let spans = exporter.get_finished_spans().expect("spans");
    let batch = spans
        .iter()
        .find(|s| s.name == "outbox.batch")
        .expect("the relay's batch span");
    assert_eq!(attribute(batch, "events"), Some(Value::I64(2)));
    assert_eq!(attribute(batch, "published"), Some(Value::I64(2)));
    let linked: Vec<_> = batch
        .links
        .links
        .iter()
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect();
    assert_eq!(
        linked,
        vec![(order.trace_id(), order.span_id())],
        "the batch links to the traced event's producer span only"
    );
    let handled = spans
        .iter()
        .find(|s| s.name == "handle_order_created")
        .expect("the consumer's span");
    assert_eq!(handled.span_context.trace_id(), order.trace_id());
    assert_eq!(handled.parent_span_id, order.span_id());

    target.delete().await;
    test.drop_schema().await.expect("drop schema");
}
