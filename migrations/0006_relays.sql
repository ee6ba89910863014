-- Relays draining a backlog of this outbox, so that ordered claims can split it
-- into shares instead of walking each other's rows: each relay claims the
-- aggregates whose key hashes to its place among the relays seen in the last few
-- seconds. Only a hint: per-aggregate order rests on the claim's locks, never on
-- this table, so a stale or missing row costs speed, not order.
CREATE TABLE {{relays}} (
    relay   uuid        NOT NULL,
    seen_at timestamptz NOT NULL,
    CONSTRAINT {{relays_pkey}} PRIMARY KEY (relay)
);
