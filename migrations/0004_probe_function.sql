-- The relay's wake-up probe: are there due events? An adaptive relay asks every
-- millisecond while traffic flows, so the question is a function: PL/pgSQL plans
-- its queries once per session, under the planner settings of the SET clauses
-- below (in force while it runs, restored when it returns: no session state left
-- behind, safe through a transaction-pooling proxy). A plain statement would need
-- the same settings sent and a plan made on every call.
--
-- ordered: a due event of an aggregate that is not held, at or after walk_start
-- (where ordered claims start walking the pending index), or a hold that expired.
-- Otherwise: any due event. Released migrations never change: a change to these
-- queries takes a migration that replaces this function (as migrations 5 and 7 do).
CREATE FUNCTION {{probe_function}}(ordered boolean, walk_start bigint)
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
                        WHERE h.aggregate_type = e.aggregate_type AND h.aggregate_id = e.aggregate_id)))
                OR EXISTS (SELECT 1 FROM {{holds}} WHERE until <= now()));
    END IF;
    RETURN (SELECT EXISTS (SELECT 1 FROM {{events}} WHERE processed_at IS NULL AND dead_at IS NULL
                AND available_at <= now()));
END
$$;
