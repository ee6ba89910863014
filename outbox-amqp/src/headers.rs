//! Names of the AMQP headers carrying the event metadata (next to the `message_id`,
//! `type`, `timestamp` and `content_type` properties): the shared envelope names of
//! [`pgoutbox_core::envelope`].

pub use pgoutbox_core::envelope::{
    AGGREGATE_ID, AGGREGATE_TYPE, CREATED_AT, EVENT_ID, EVENT_TYPE, RESERVED,
};
