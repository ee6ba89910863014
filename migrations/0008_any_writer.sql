-- Any writer: a producer in any language writes an event with one plain SQL
-- statement, without a client library (docs/sql-contract.md).

-- Table mode: every column but the four the seed's producer names has a default,
-- so its `INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type,
-- payload) VALUES ($1, $2, $3, $4)` works as it is. A random (v4) UUID: the id is
-- only the dedup key, ordering rests on `seq`.
ALTER TABLE {{events}} ALTER COLUMN id SET DEFAULT gen_random_uuid();

-- The relay reads headers as a map of strings: a row with anything else would stop
-- every claim that meets it, so plain-SQL writers get this error at their INSERT
-- instead. NOT VALID: rows written before were written by `enqueue`, and checking
-- them would scan the table under an exclusive lock.
ALTER TABLE {{events}} ADD CONSTRAINT {{events_headers_check}} CHECK (
    jsonb_typeof(headers) = 'object'
    AND NOT headers ? ''
    AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")')
) NOT VALID;

-- The dead-letter view with the seed's `processed_at` too, so that a query written
-- for the seed's view (`SELECT *` of the events table) finds every column it names.
CREATE OR REPLACE VIEW {{dead_letters}} AS
    SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers,
           destination, attempts, last_error, created_at, dead_at, processed_at
    FROM {{events}}
    WHERE dead_at IS NOT NULL AND processed_at IS NULL;

-- WAL mode: whether this database may emit an event now. An event emitted where
-- no replication slot of this database reads the outbox's messages is never
-- published, so until the WAL outbox is set up here this refuses every write; the
-- setup (`outbox migrate` with [wal] enabled, `wal::slot::guard_emit_function`)
-- replaces it with a check of the outbox's slot on every call, and the emit
-- function below needs no change.
CREATE FUNCTION {{emit_check_function}}() RETURNS void
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RAISE EXCEPTION 'pgoutbox: WAL outbox write refused: the WAL outbox is not set up in this database (no replication slot reads its events, so they would never be published): run outbox migrate with [wal] enabled'
        USING ERRCODE = 'object_not_in_prerequisite_state';
END
$$;

-- WAL mode: emit one event as a transactional logical message, in the caller's
-- transaction, exactly as `WalOutbox::enqueue` does (outbox-postgres
-- `wal::WalMessage`, format version 1): it is published if and only if the
-- transaction commits. Input is validated as `enqueue` validates it; an invalid
-- event raises an error (SQLSTATE 22023) and nothing is emitted. Returns the id.
CREATE FUNCTION {{emit_function}}(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        text,
    headers        jsonb DEFAULT '{}'::jsonb,
    destination    text  DEFAULT NULL,
    id             uuid  DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    event_id uuid := COALESCE(id, gen_random_uuid());
    field record;
    header record;
    at timestamp := clock_timestamp() AT TIME ZONE 'UTC';
    micros bigint;
BEGIN
    FOR field IN
        SELECT f.name, f.value FROM unnest(
            ARRAY['aggregate_type', 'aggregate_id', 'event_type', 'destination'],
            ARRAY[aggregate_type, aggregate_id, event_type, destination]) AS f(name, value)
    LOOP
        CONTINUE WHEN field.name = 'destination' AND field.value IS NULL;
        IF field.value IS NULL OR field.value !~ '[^[:space:]]' THEN
            RAISE EXCEPTION 'event field `%` is empty', field.name
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length(field.value) > 1024 THEN
            RAISE EXCEPTION 'event field `%` is % bytes long; the limit is 1024',
                field.name, octet_length(field.value)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    headers := COALESCE(headers, '{}'::jsonb);
    IF jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION 'headers of event % are a JSON %, not an object of strings',
            event_id, jsonb_typeof(headers) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR header IN SELECT h.key, h.value FROM jsonb_each(headers) AS h LOOP
        IF header.key = '' THEN
            RAISE EXCEPTION 'event % has a header with an empty name', event_id
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF jsonb_typeof(header.value) <> 'string' THEN
            RAISE EXCEPTION 'header `%` of event % is a JSON %, not a string',
                header.key, event_id, jsonb_typeof(header.value)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    IF payload IS NULL THEN
        RAISE EXCEPTION 'payload of event % (%) is not valid JSON: it is NULL',
            event_id, event_type USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        PERFORM payload::json;
    EXCEPTION WHEN data_exception THEN
        RAISE EXCEPTION 'payload of event % (%) is not valid JSON: %',
            event_id, event_type, SQLERRM USING ERRCODE = 'invalid_parameter_value';
    END;
    IF position(E'\\u0000' IN payload) > 0 THEN
        RAISE EXCEPTION 'payload of event % (%) is not valid JSON: contains \u0000, which PostgreSQL jsonb cannot store',
            event_id, event_type USING ERRCODE = 'invalid_parameter_value';
    END IF;

    PERFORM {{emit_check_function}}();

    -- The message text as serde_json writes `WalMessage`: members in this order, no
    -- spaces, the payload verbatim but for JSON whitespace around it, headers sorted by name (bytes), created_at in
    -- RFC 3339 UTC with 0, 3 or 6 fraction digits as chrono prints it.
    micros := extract(microseconds FROM at)::bigint % 1000000;
    PERFORM pg_logical_emit_message(true, {{wal_prefix}},
        '{"v":1,"id":"' || event_id::text
        || '","aggregate_type":' || to_json(aggregate_type)::text
        || ',"aggregate_id":' || to_json(aggregate_id)::text
        || ',"event_type":' || to_json(event_type)::text
        || ',"payload":' || btrim(payload, E' \t\n\r')
        || ',"headers":{' || COALESCE((
               SELECT string_agg(to_json(h.key)::text || ':' || to_json(h.value)::text, ','
                                 ORDER BY h.key COLLATE "C")
               FROM jsonb_each_text(headers) AS h), '')
        || '},"destination":' || COALESCE(to_json(destination)::text, 'null')
        || ',"created_at":"' || to_char(at, 'YYYY-MM-DD"T"HH24:MI:SS')
        || CASE WHEN micros = 0 THEN ''
                WHEN micros % 1000 = 0 THEN '.' || lpad((micros / 1000)::text, 3, '0')
                ELSE '.' || lpad(micros::text, 6, '0') END
        || 'Z"}');
    RETURN event_id;
END
$$;
