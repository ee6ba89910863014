//! Structured-mode CloudEvents are valid against the CloudEvents 1.0 JSON schema
//! (`cloudevents-1.0.schema.json`, `cloudevents/formats/cloudevents.json` of the
//! CloudEvents specification, Apache-2.0), with formats (`uri-reference`,
//! `date-time`) asserted; binary mode names its headers by the broker's binding.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use pgoutbox_core::envelope::{
    Binding, CloudEvents, Envelope, EnvelopeConfigError, Format, Metadata,
};

use pgoutbox_core::Event;
use serde_json::value::RawValue;

fn event(aggregate_type: &str, aggregate_id: &str, event_type: &str) -> Event {
    let payload = RawValue::from_string(r#"{"seq":1}"#.into()).unwrap();
    Event::new(
        uuid::Uuid::now_v7(),
        aggregate_type,
        aggregate_id,
        event_type,
        payload,
        chrono::Utc::now(),
    )
}

const SCHEMA: &str = include_str!("cloudevents-1.0.schema.json");
const KAFKA: Binding = Binding::new("ce_", Some("content-type"));
const AMQP: Binding = Binding::new("cloudEvents:", None);

struct Validator {
    schemas: boon::Schemas,
    index: boon::SchemaIndex,
}

impl Validator {
    fn new() -> Self {
        let mut schemas = boon::Schemas::new();
        let mut compiler = boon::Compiler::new();
        compiler.enable_format_assertions();
        let url = "https://cloudevents.io/schemas/cloudevents-1.0.json";
        compiler
            .add_resource(url, serde_json::from_str(SCHEMA).expect("schema is JSON"))
            .expect("schema resource");
        let index = compiler
            .compile(url, &mut schemas)
            .expect("schema compiles");
        Self { schemas, index }
    }

    fn check(&self, body: &[u8]) -> Result<(), String> {
        let instance: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| e.to_string())?;
        self.schemas
            .validate(&instance, self.index)
            .map_err(|e| format!("{e:#}"))
    }
}

#[test]
fn structured_mode_is_valid_against_the_cloudevents_schema() {
    let validator = Validator::new();
    let envelope = Envelope::CloudEvents(
        CloudEvents::structured("urn:example:orders")
            .unwrap()
            .subject("{aggregate_type}/{aggregate_id}")
            .unwrap(),
    );
    let payloads = [
        serde_json::json!({ "total_cents": 1999, "note": "Zo\u{eb} \u{2713}" }),
        serde_json::json!("a bare string"),
        serde_json::json!([1, 2, 3]),
        serde_json::json!(null),
    ];
    for payload in payloads {
        let mut e = event("order", "o-7", "order.created");
        e.payload = RawValue::from_string(payload.to_string()).unwrap();
        let encoded = envelope.encode(&e, &KAFKA);
        assert_eq!(encoded.content_type, Some("application/cloudevents+json"));
        validator
            .check(&encoded.body)
            .unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(&encoded.body)));
        let document: serde_json::Value = serde_json::from_slice(&encoded.body).unwrap();
        assert_eq!(document["specversion"], "1.0");
        assert_eq!(document["id"], e.id.to_string());
        assert_eq!(document["source"], "urn:example:orders");
        assert_eq!(document["type"], "order.created");
        assert_eq!(document["subject"], "order/o-7");
        assert_eq!(document["aggregateid"], "o-7");
        assert_eq!(document["datacontenttype"], "application/json");
        assert_eq!(document["data"], payload);
        let time = document["time"].as_str().unwrap();
        assert_eq!(
            chrono::DateTime::parse_from_rfc3339(time)
                .unwrap()
                .timestamp_micros(),
            e.created_at.timestamp_micros()
        );
    }
}

#[test]
fn the_schema_check_rejects_what_is_not_a_cloudevent() {
    // The validator is not vacuous: each of these breaks one rule of the schema.
    let validator = Validator::new();
    let valid = serde_json::json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "t"});
    assert!(validator.check(valid.to_string().as_bytes()).is_ok());
    for (field, value) in [
        ("source", serde_json::Value::Null),
        ("id", serde_json::json!("")),
        ("time", serde_json::json!("yesterday")),
        ("source", serde_json::json!("not a uri reference")),
    ] {
        let mut broken = valid.clone();
        broken[field] = value;
        assert!(
            validator.check(broken.to_string().as_bytes()).is_err(),
            "{broken} passed"
        );
    }
}

#[test]
fn binary_mode_uses_the_bindings_prefix_and_reads_back() {
    let mut e = event("order", "o-7", "order.created");
    e.headers.insert("traceparent".into(), "00-a-b-01".into());
    e.headers
        .insert("cloudEvents:type".into(), "spoofed".into());
    let envelope =
        Envelope::CloudEvents(CloudEvents::binary("/orders").unwrap().subject("").unwrap());
    let encoded = envelope.encode(&e, &AMQP);
    let names: Vec<&str> = encoded.metadata.iter().map(|(n, _)| n.as_ref()).collect();
    assert_eq!(
        names,
        [
            "cloudEvents:specversion",
            "cloudEvents:id",
            "cloudEvents:source",
            "cloudEvents:type",
            "cloudEvents:time",
            "cloudEvents:aggregatetype",
            "cloudEvents:aggregateid",
        ]
    );
    assert_eq!(encoded.headers, [("traceparent", "00-a-b-01")]);
    assert_eq!(encoded.body.as_ref(), e.payload_str().as_bytes());
    assert_eq!(encoded.content_type, Some("application/json"));
    // AMQP carries the content type as a property: the adapter passes it.
    let meta = Metadata::from_message(
        &AMQP,
        encoded.all_headers(),
        encoded.content_type,
        &encoded.body,
    )
    .expect("metadata");
    assert_eq!(meta.format, Format::CloudEventsBinary);
    assert_eq!(
        (meta.event_id, meta.event_type.as_str()),
        (e.id, "order.created")
    );
    assert_eq!(meta.subject, None);
    assert_eq!(meta.source.as_deref(), Some("/orders"));
    assert_eq!(
        meta.payload(&encoded.body).unwrap(),
        e.payload_str().as_bytes()
    );
}

#[test]
fn bad_settings_and_foreign_cloudevents_are_named() {
    assert_eq!(
        CloudEvents::binary("").unwrap_err(),
        EnvelopeConfigError::Source(String::new())
    );
    assert!(CloudEvents::binary("/a b").is_err());
    let err = CloudEvents::binary("/s")
        .unwrap()
        .subject("{tenant}/{aggregate_id}")
        .unwrap_err();
    assert!(
        err.to_string().contains("unknown placeholder {tenant}"),
        "{err}"
    );
    assert!(CloudEvents::binary("/s")
        .unwrap()
        .subject("{aggregate_id")
        .is_err());
    assert_eq!(
        "zipped"
            .parse::<pgoutbox_core::envelope::ContentMode>()
            .unwrap_err()
            .to_string(),
        "unknown CloudEvents content mode \"zipped\": expected `binary` or `structured`"
    );

    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    };
    assert_eq!(Envelope::from_lookup(vars(&[])).unwrap(), Envelope::Outbox);
    assert_eq!(
        Envelope::from_lookup(vars(&[("OUTBOX_ENVELOPE", "cloudevents-binary")])).unwrap_err(),
        EnvelopeConfigError::SourceMissing
    );
    let err = Envelope::from_lookup(vars(&[("OUTBOX_ENVELOPE", "cloudevent")])).unwrap_err();
    assert!(err.to_string().contains("OUTBOX_ENVELOPE"), "{err}");
    let Envelope::CloudEvents(ce) = Envelope::from_lookup(vars(&[
        ("OUTBOX_ENVELOPE", "cloudevents-structured"),
        ("OUTBOX_CLOUDEVENTS_SOURCE", "/orders"),
    ]))
    .unwrap() else {
        panic!("not CloudEvents")
    };
    assert_eq!(
        (ce.mode(), ce.source()),
        (pgoutbox_core::envelope::ContentMode::Structured, "/orders")
    );

    // A CloudEvent from another producer, without the outbox's extensions.
    let foreign = serde_json::json!({
        "specversion": "1.0", "id": "0190a0a0-0000-7000-8000-000000000001",
        "source": "/elsewhere", "type": "thing.happened", "data": {}
    });
    let body = foreign.to_string();
    let err = Metadata::from_message(
        &KAFKA,
        [(
            "content-type",
            "application/cloudevents+json; charset=utf-8",
        )],
        None,
        body.as_bytes(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "CloudEvent has no `aggregatetype` attribute: not published by the outbox?"
    );
    let err = Metadata::from_message(
        &KAFKA,
        [("ce_specversion", "0.3"), ("ce_id", "x")],
        None,
        b"{}",
    )
    .unwrap_err();
    assert!(err.to_string().contains("specversion"), "{err}");
}
