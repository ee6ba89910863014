-- Aggregates held back while per-aggregate ordering is on: the aggregate's oldest
-- unpublished event is not due before `until` (retry backoff, delayed delivery),
-- or is a dead letter that blocks it (AfterDeadLetter::Block, rechecked at
-- `until`). Claims skip a held aggregate's events with one primary-key probe
-- instead of reading them, and take the aggregate up again once `until` passed.
-- Only relays and dead-letter administration write here; producers never do.
CREATE TABLE {{holds}} (
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    until          timestamptz NOT NULL,
    CONSTRAINT {{holds_pkey}} PRIMARY KEY (aggregate_type, aggregate_id)
);
CREATE INDEX {{holds_until_idx}} ON {{holds}} (until);
