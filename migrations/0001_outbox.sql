-- The outbox schema. Names in double braces are replaced by validated, quoted
-- identifiers (see outbox-postgres `Tables`), so one schema can hold several outboxes.

-- Events written in the producer's transaction. `seq` orders events (per aggregate);
-- `created_at` cannot, because now() is the transaction's start time.
CREATE TABLE {{events}} (
    seq            bigint      GENERATED ALWAYS AS IDENTITY,
    id             uuid        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    destination    text,
    attempts       integer     NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- not before: delayed delivery and retry backoff
    available_at   timestamptz NOT NULL DEFAULT now(),
    processed_at   timestamptz,
    dead_at        timestamptz,
    last_error     text,
    CONSTRAINT {{events_pkey}} PRIMARY KEY (id)
);

-- The hot claim index: only events still to publish. Dead letters leave it.
CREATE INDEX {{events_pending_idx}} ON {{events}} (seq)
    WHERE processed_at IS NULL AND dead_at IS NULL;

-- Per-aggregate ordering: "is there an earlier unpublished event of this aggregate?"
CREATE INDEX {{events_aggregate_idx}} ON {{events}} (aggregate_type, aggregate_id, seq)
    WHERE processed_at IS NULL;

-- Dead-letter administration and retention cleanup.
CREATE INDEX {{events_dead_idx}} ON {{events}} (dead_at)
    WHERE dead_at IS NOT NULL AND processed_at IS NULL;
CREATE INDEX {{events_processed_idx}} ON {{events}} (processed_at)
    WHERE processed_at IS NOT NULL;

CREATE VIEW {{dead_letters}} AS
    SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers,
           destination, attempts, last_error, created_at, dead_at
    FROM {{events}}
    WHERE dead_at IS NOT NULL AND processed_at IS NULL;

-- Consumer inbox: one row per (consumer, event) processed, written in the
-- consumer's transaction so a duplicate delivery is recognised.
CREATE TABLE IF NOT EXISTS {{inbox}} (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT {{inbox_pkey}} PRIMARY KEY (consumer, event_id)
);
CREATE INDEX IF NOT EXISTS {{inbox_processed_idx}} ON {{inbox}} (processed_at);
