//! What a broker's factory is given: its section of the configuration file, the
//! routing rules and the envelope.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pgoutbox_core::envelope::Envelope;
use serde::de::{DeserializeOwned, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::Deserializer;

use crate::config::{self, ConfigText, Settings};

use super::BoxError;

/// A broker's settings as the binary read them, given to its
/// [`BrokerFactory`](super::BrokerFactory).
///
/// A factory reads what it uses: its `[broker.<kind>]` section ([`parse`](Self::parse)
/// or [`section`](Self::section)), the `[routing]` rules and the `[envelope]`. When
/// the configuration has routing rules or an envelope the factory never asks for,
/// the binary warns that they are ignored.
pub struct BrokerInput {
    kind: String,
    section: toml::Table,
    /// The configuration file's text, for errors that name the line.
    text: Option<Arc<ConfigText>>,
    event_type: BTreeMap<String, String>,
    aggregate_type: BTreeMap<String, String>,
    envelope: Envelope,
    create_missing: bool,
    routing_read: AtomicBool,
    envelope_read: AtomicBool,
}

impl BrokerInput {
    pub(crate) fn new(kind: &str, settings: &Settings) -> Self {
        let section = match settings.broker.sections.get(kind) {
            Some(toml::Value::Table(table)) => table.clone(),
            _ => toml::Table::new(),
        };
        Self {
            kind: kind.to_string(),
            section,
            text: settings.broker.text.clone(),
            event_type: settings.routing.event_type.clone(),
            aggregate_type: settings.routing.aggregate_type.clone(),
            envelope: settings.envelope.clone(),
            create_missing: false,
            routing_read: AtomicBool::new(false),
            envelope_read: AtomicBool::new(false),
        }
    }

    /// The broker's kind: `broker.kind`.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The `[broker.<kind>]` section (empty when the file has none).
    pub fn section(&self) -> &toml::Table {
        &self.section
    }

    /// The `[broker.<kind>]` section, owned.
    pub fn into_section(self) -> toml::Table {
        self.section
    }

    /// The `[broker.<kind>]` section as `T`. A mistake in it (an unknown key, a
    /// value of the wrong type) is reported with the file's name and line.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, BoxError> {
        match &self.text {
            Some(text) => section_from_text(text, &self.kind),
            None => Ok(self.section.clone().try_into()?),
        }
    }

    /// `[routing.event_type]`: destination by event type.
    pub fn routes_by_event_type(&self) -> &BTreeMap<String, String> {
        self.routing_read.store(true, Ordering::Relaxed);
        &self.event_type
    }

    /// `[routing.aggregate_type]`: destination by aggregate type (an event type's
    /// rule wins, and an event's own destination over both).
    pub fn routes_by_aggregate_type(&self) -> &BTreeMap<String, String> {
        self.routing_read.store(true, Ordering::Relaxed);
        &self.aggregate_type
    }

    /// How events are encoded: `[envelope]`.
    pub fn envelope(&self) -> &Envelope {
        self.envelope_read.store(true, Ordering::Relaxed);
        &self.envelope
    }

    /// Whether to create what the settings name when it is missing (a stream, a
    /// topic): true for `outbox relay`, false for `outbox check`, which creates nothing.
    pub fn creates_missing(&self) -> bool {
        self.create_missing
    }

    pub(crate) fn create_missing(mut self, yes: bool) -> Self {
        self.create_missing = yes;
        self
    }

    /// Warn of configured routing rules or envelope the factory did not read.
    pub(crate) fn warn_unused(&self) {
        let kind = &self.kind;
        let has_rules = !self.event_type.is_empty() || !self.aggregate_type.is_empty();
        if has_rules && !self.routing_read.load(Ordering::Relaxed) {
            tracing::warn!("broker {kind}: [routing] rules are not used by this broker; ignored");
        }
        if self.envelope != Envelope::Outbox && !self.envelope_read.load(Ordering::Relaxed) {
            tracing::warn!("broker {kind}: [envelope] is not used by this broker; ignored");
        }
    }
}

impl fmt::Debug for BrokerInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The section may hold credentials: only its keys.
        f.debug_struct("BrokerInput")
            .field("kind", &self.kind)
            .field("section_keys", &self.section.keys().collect::<Vec<_>>())
            .field("create_missing", &self.create_missing)
            .finish_non_exhaustive()
    }
}

/// `[broker.<kind>]` of the file's text as `T`, deserialised from the text itself so
/// that an error carries its line.
fn section_from_text<T: DeserializeOwned>(text: &ConfigText, kind: &str) -> Result<T, BoxError> {
    let located = |e: toml::de::Error| -> BoxError {
        format!(
            "config file {}{}",
            text.path,
            config::toml_error(&text.text, &e)
        )
        .into()
    };
    let document = toml::Deserializer::parse(&text.text).map_err(located)?;
    let found = document
        .deserialize_any(At::<T> {
            keys: &["broker", kind],
            _t: PhantomData,
        })
        .map_err(located)?;
    match found {
        Some(value) => Ok(value),
        // No section in the file: the type's defaults (the environment may set the rest).
        None => Ok(toml::Table::new().try_into()?),
    }
}

/// Deserialises the value at `keys` (tables all the way down), skipping the rest.
struct At<'a, 'k, T> {
    keys: &'a [&'k str],
    _t: PhantomData<T>,
}

impl<'de, T: DeserializeOwned> DeserializeSeed<'de> for At<'_, '_, T> {
    type Value = Option<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<T>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, T: DeserializeOwned> Visitor<'de> for At<'_, '_, T> {
    type Value = Option<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a table")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<T>, A::Error> {
        let mut found = None;
        while let Some(key) = map.next_key::<String>()? {
            if key != self.keys[0] {
                map.next_value::<IgnoredAny>()?;
            } else if self.keys.len() == 1 {
                found = Some(map.next_value::<T>()?);
            } else {
                found = map.next_value_seed(At::<T> {
                    keys: &self.keys[1..],
                    _t: PhantomData,
                })?;
            }
        }
        Ok(found)
    }
}
