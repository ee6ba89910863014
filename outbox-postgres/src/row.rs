//! Decoding outbox rows into core events.
//!
//! Columns are read by position: a lookup by name hashes the name for every column
//! of every row, a visible share of the relay's CPU time on a drain
//! (docs/benchmarks-history.md).
//! Every statement that returns events starts with `sql::EVENT_COLUMNS`; the
//! columns it adds after them are named in [`column`]. Debug builds (the tests)
//! check each position against its name and type.

use pgoutbox_core::{Event, Headers};
use serde_json::value::RawValue;
use sqlx::postgres::PgRow;
use sqlx::{Column, Decode, Postgres, Row, Type};

/// Positions of the columns read after `sql::EVENT_COLUMNS`.
pub(crate) mod column {
    /// A column: position and name.
    pub(crate) type Column = (usize, &'static str);

    /// `sql::EVENT_COLUMNS` has ten columns.
    const AFTER_EVENT: usize = 10;

    /// Ordered claim, step 1 (`claim_aggregates`).
    pub(crate) mod walked {
        use super::{Column, AFTER_EVENT};
        pub(crate) const WAITS_UNTIL: Column = (AFTER_EVENT, "waits_until");
        pub(crate) const CLEAN: Column = (AFTER_EVENT + 1, "clean");
        pub(crate) const SKIPPED_BEFORE: Column = (AFTER_EVENT + 2, "skipped_before");
        pub(crate) const HELD: Column = (AFTER_EVENT + 3, "held");
        pub(crate) const SKIPPED_FROM: Column = (AFTER_EVENT + 4, "skipped_from");
    }

    /// Ordered claim, step 2 (`claim_runs`).
    pub(crate) mod read_again {
        use super::{Column, AFTER_EVENT};
        pub(crate) const WAITS_UNTIL: Column = (AFTER_EVENT, "waits_until");
        pub(crate) const DEAD: Column = (AFTER_EVENT + 1, "dead");
    }

    /// Dead letters (`dead_list`).
    pub(crate) mod dead {
        use super::{Column, AFTER_EVENT};
        pub(crate) const LAST_ERROR: Column = (AFTER_EVENT, "last_error");
        pub(crate) const DEAD_AT: Column = (AFTER_EVENT + 1, "dead_at");
    }

    /// The columns of `sql::EVENT_COLUMNS`.
    pub(crate) const SEQ: Column = (0, "seq");
    pub(crate) const ID: Column = (1, "id");
    pub(crate) const AGGREGATE_TYPE: Column = (2, "aggregate_type");
    pub(crate) const AGGREGATE_ID: Column = (3, "aggregate_id");
    pub(crate) const EVENT_TYPE: Column = (4, "event_type");
    pub(crate) const PAYLOAD: Column = (5, "payload");
    pub(crate) const HEADERS: Column = (6, "headers");
    pub(crate) const DESTINATION: Column = (7, "destination");
    pub(crate) const ATTEMPTS: Column = (8, "attempts");
    pub(crate) const CREATED_AT: Column = (9, "created_at");
}

/// The value of `column` in `row`.
///
/// Release builds skip sqlx's type compatibility check, which builds and drops a
/// list of type descriptions for every value (a fifth of the claim's decoding time):
/// the statements are this crate's own, and debug builds (the tests) check every
/// value's name and type.
pub(crate) fn get<'r, T>(row: &'r PgRow, (index, name): column::Column) -> Result<T, sqlx::Error>
where
    T: Decode<'r, Postgres> + Type<Postgres>,
{
    if cfg!(debug_assertions) {
        assert_eq!(
            row.columns().get(index).map(|c| c.name()),
            Some(name),
            "column {index} of the statement"
        );
        row.try_get(index)
    } else {
        row.try_get_unchecked(index)
    }
}

/// Decode the columns of `sql::EVENT_COLUMNS`.
pub(crate) fn event(row: &PgRow) -> Result<Event, sqlx::Error> {
    use column::*;
    let decode = |column: &str, e: serde_json::Error| sqlx::Error::ColumnDecode {
        index: column.to_string(),
        source: Box::new(e),
    };
    let payload: String = get(row, PAYLOAD)?;
    let headers: &str = get(row, HEADERS)?;
    let attempts: i32 = get(row, ATTEMPTS)?;
    let mut event = Event::new(
        get(row, ID)?,
        get::<String>(row, AGGREGATE_TYPE)?,
        get::<String>(row, AGGREGATE_ID)?,
        get::<String>(row, EVENT_TYPE)?,
        RawValue::from_string(payload).map_err(|e| decode(PAYLOAD.1, e))?,
        get(row, CREATED_AT)?,
    );
    event.seq = get(row, SEQ)?;
    event.headers = serde_json::from_str::<Headers>(headers).map_err(|e| decode(HEADERS.1, e))?;
    event.destination = get(row, DESTINATION)?;
    event.attempts = u32::try_from(attempts).unwrap_or(0);
    Ok(event)
}
