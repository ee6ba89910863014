-- The wake-up probe of migration 4 again, with its "aggregate not held" check
-- fenced: `NOT EXISTS (... OFFSET 0)`, one
-- primary-key probe of the holds table per row. Migration 4 as first released let
-- the planner hash the whole holds table instead (it did under the function's
-- generic plan when the table was analysed while empty), so that every probe, sent
-- every millisecond while traffic flows, read every hold: O(holds) during a long
-- partial outage. The definition is otherwise that of migration 4.
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
        RETURN (SELECT EXISTS (SELECT 1 FROM {{events}} e WHERE e.processed_at IS NULL
                    AND e.dead_at IS NULL AND e.seq >= walk_start AND e.available_at <= now()
                    AND (NOT EXISTS (SELECT 1 FROM {{holds}}) OR NOT EXISTS (SELECT 1 FROM {{holds}} h
                        WHERE h.aggregate_type = e.aggregate_type AND h.aggregate_id = e.aggregate_id
                        OFFSET 0)))
                OR EXISTS (SELECT 1 FROM {{holds}} WHERE until <= now()));
    END IF;
    RETURN (SELECT EXISTS (SELECT 1 FROM {{events}} WHERE processed_at IS NULL AND dead_at IS NULL
                AND available_at <= now()));
END
$$;
