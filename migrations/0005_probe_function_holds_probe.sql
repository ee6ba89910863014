-- The wake-up probe of migration 4 again, with the queries `Sql` renders now: its
-- "aggregate not held" check is a fenced `NOT EXISTS (... OFFSET 0)`, one
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
        RETURN ({{probe_due_ordered_query}});
    END IF;
    RETURN ({{probe_due_unordered_query}});
END
$$;
