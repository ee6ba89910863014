-- Where walks of the pending index start (`walk_start.rs` in pgoutbox-postgres),
-- kept for relays that start later: one row for ordered relays, one for
-- unordered ones, each written by a running relay at most every few seconds.
--
-- A relay that starts without it walks from the beginning of the pending index
-- until its own observations move its start: over the index entries of every
-- event published since the last vacuum, and, while a session holds back the
-- xmin horizon (pg_dump, a long report, a replica's hot_standby_feedback), over
-- every event published since that snapshot was taken, on every claim.
--
-- Only a hint: a saved start is one some relay adopted, below which every
-- pending event belongs to a held aggregate (ordered) or none is pending
-- (unordered); that stays true as events are published. Events put back below
-- it by hand are found by the relays' look below the start, as before. A saved
-- start above the events' sequence (the table truncated and its identity
-- restarted) is ignored. Relays of earlier versions do not read the table.
CREATE TABLE {{walk_starts}} (
    ordered  boolean     NOT NULL,
    from_seq bigint      NOT NULL,
    saved_at timestamptz NOT NULL,
    CONSTRAINT {{walk_starts_pkey}} PRIMARY KEY (ordered)
);
