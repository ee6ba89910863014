//! Decoding outbox rows into core events.

use outbox_core::{Event, Headers};
use serde_json::value::RawValue;
use sqlx::postgres::PgRow;
use sqlx::Row;

/// Decode the columns of `sql::EVENT_COLUMNS`.
pub(crate) fn event(row: &PgRow) -> Result<Event, sqlx::Error> {
    let decode = |column: &str, e: serde_json::Error| sqlx::Error::ColumnDecode {
        index: column.to_string(),
        source: Box::new(e),
    };
    let payload: String = row.try_get("payload")?;
    let headers: String = row.try_get("headers")?;
    let attempts: i32 = row.try_get("attempts")?;
    Ok(Event {
        seq: row.try_get("seq")?,
        id: row.try_get("id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        event_type: row.try_get("event_type")?,
        payload: RawValue::from_string(payload).map_err(|e| decode("payload", e))?,
        headers: serde_json::from_str::<Headers>(&headers).map_err(|e| decode("headers", e))?,
        destination: row.try_get("destination")?,
        created_at: row.try_get("created_at")?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}
