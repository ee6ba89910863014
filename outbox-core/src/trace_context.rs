//! OpenTelemetry trace context through the outbox (feature `opentelemetry`).
//!
//! - **Producer**: an event enqueued inside a span carries that span's context as W3C
//!   `traceparent` (and `tracestate`) headers: `pgoutbox-postgres` adds them at enqueue
//!   when its `opentelemetry` feature is on and the event has no `traceparent` yet
//!   ([`NewEvent::with_current_trace_context`] does the same by hand).
//! - **Relay**: each batch runs in an info-level `outbox.batch` span that is
//!   **linked** to the trace of every event in it. A batch holds events of many
//!   traces, so it cannot be the child of each; a link keeps every producer trace
//!   one click away from the publish that carried it.
//! - **Consumer**: [`follow`] makes the consumer's span a child of the producer's
//!   span, from the headers every adapter hands back; [`extract`] gives the context.
//!
//! Spans reach OpenTelemetry through a `tracing-opentelemetry` layer in the
//! application's subscriber; without one there is no current context and nothing
//! is added.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::event::{Headers, NewEvent, TRACEPARENT};

/// Header name of the W3C trace state, carried with `traceparent`.
pub const TRACESTATE: &str = "tracestate";

struct HeadersInjector<'a>(&'a mut Headers);

impl Injector for HeadersInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

struct HeadersExtractor<'a>(&'a Headers);

impl Extractor for HeadersExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(key))
            .map(|(_, value)| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// The W3C headers (`traceparent`, `tracestate`) of the current `tracing` span's
/// OpenTelemetry context; empty when there is no valid one.
pub fn current_trace_headers() -> Headers {
    let context = tracing::Span::current().context();
    let mut headers = Headers::new();
    if context.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&context, &mut HeadersInjector(&mut headers));
    }
    headers
}

/// The trace context `headers` carry (a remote span context), or an empty context
/// when they carry none or an invalid one.
pub fn extract(headers: &Headers) -> Context {
    TraceContextPropagator::new().extract(&HeadersExtractor(headers))
}

/// Make `span` a child of the span that enqueued the event whose `headers` these
/// are (consumer side; call before entering `span`). Does nothing when the headers
/// carry no valid trace context.
///
/// ```no_run
/// # fn demo(headers: &pgoutbox_core::Headers) {
/// let span = tracing::info_span!("handle order.created");
/// pgoutbox_core::trace_context::follow(&span, headers);
/// let _entered = span.enter();
/// # }
/// ```
pub fn follow(span: &tracing::Span, headers: &Headers) {
    let context = extract(headers);
    if context.span().span_context().is_valid() {
        // Fails only when the span is already closed or disabled: nothing to follow then.
        let _ = span.set_parent(context);
    }
}

/// Link `span` (the relay's batch span) to the trace of each event that carries one.
pub(crate) fn link_events<'a>(span: &tracing::Span, headers: impl Iterator<Item = &'a Headers>) {
    for event_headers in headers.filter(|h| h.contains_key(TRACEPARENT)) {
        let context = extract(event_headers);
        let span_context = context.span().span_context().clone();
        if span_context.is_valid() {
            span.add_link(span_context);
        }
    }
}

impl NewEvent {
    /// Record the current span's trace context (`traceparent`, `tracestate`) unless
    /// the event already carries a `traceparent`.
    #[must_use]
    pub fn with_current_trace_context(mut self) -> Self {
        if !self.headers.contains_key(TRACEPARENT) {
            self.headers.extend(current_trace_headers());
        }
        self
    }
}
