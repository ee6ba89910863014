-- Held aggregates carry a lower bound of their pending events' `seq`, and the
-- table a new name.
--
-- Ordered walks start past the events of held aggregates (a retry backing off,
-- the followers of a blocking dead letter, a delayed event): relays take those
-- events up through this table when the hold expires, from `from_seq` (NULL:
-- from the aggregate's oldest event) through the aggregate index. A walk that
-- stepped over them also stepped over the index entries of every event
-- published since, which vacuum cannot remove while any session holds back the
-- xmin horizon (pg_dump, a long report, a replica's hot_standby_feedback).
-- Invariant: every pending event of a held aggregate has `seq >= from_seq`, and
-- a relay deletes a hold only in the transaction that publishes all of its
-- aggregate's pending events.
--
-- The new name fences off relays of earlier versions, which lift a hold after
-- reading the first 16 events of its aggregate and would leave the rest behind
-- the walk start of the relays of this version. Their claims fail with
-- "relation ... does not exist" until they are replaced; nothing is lost or
-- reordered meanwhile, and producers are not affected.
ALTER TABLE {{holds}} RENAME TO {{held_table}};
ALTER TABLE {{held}} RENAME CONSTRAINT {{holds_pkey}} TO {{held_pkey}};
ALTER INDEX {{schema}}.{{holds_until_idx}} RENAME TO {{held_until_idx}};
ALTER TABLE {{held}} ADD COLUMN from_seq bigint;

-- The wake-up probe on the renamed table; unordered relays now walk from a
-- start too (`walk_start`), as ordered ones do. Each query asks for the first due
-- event in `seq` order instead of `EXISTS`: the planner drops the order of an
-- `EXISTS` subquery and may then read the whole aggregate index (its predicate
-- fits too) for `seq >= walk_start`, entries of published events included.
CREATE OR REPLACE FUNCTION {{probe_function}}(ordered boolean, walk_start bigint)
    RETURNS boolean
    LANGUAGE plpgsql STABLE
    SET enable_seqscan = off
    SET enable_bitmapscan = off
    SET enable_sort = off
    SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    IF ordered THEN
        RETURN (SELECT (SELECT e.seq FROM {{events}} e WHERE e.processed_at IS NULL
                    AND e.dead_at IS NULL AND e.seq >= walk_start AND e.available_at <= now()
                    AND (NOT EXISTS (SELECT 1 FROM {{held}}) OR NOT EXISTS (SELECT 1 FROM {{held}} h
                        WHERE h.aggregate_type = e.aggregate_type AND h.aggregate_id = e.aggregate_id
                        OFFSET 0))
                    ORDER BY e.seq LIMIT 1) IS NOT NULL
                OR EXISTS (SELECT 1 FROM {{held}} WHERE until <= now()));
    END IF;
    RETURN (SELECT (SELECT seq FROM {{events}} WHERE processed_at IS NULL AND dead_at IS NULL
                AND seq >= walk_start AND available_at <= now() ORDER BY seq LIMIT 1) IS NOT NULL);
END
$$;
