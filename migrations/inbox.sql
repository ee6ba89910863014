-- Consumer inbox: one row per (consumer, event) processed, written in the
-- consumer's transaction so a duplicate delivery is recognised.
CREATE TABLE IF NOT EXISTS {{inbox}} (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT {{inbox_pkey}} PRIMARY KEY (consumer, event_id)
);
CREATE INDEX IF NOT EXISTS {{inbox_processed_idx}} ON {{inbox}} (processed_at);
