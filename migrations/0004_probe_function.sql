-- The relay's wake-up probe: are there due events? An adaptive relay asks every
-- millisecond while traffic flows, so the question is a function: PL/pgSQL plans
-- its queries once per session, under the planner settings of the SET clauses
-- below (in force while it runs, restored when it returns: no session state left
-- behind, safe through a transaction-pooling proxy). A plain statement would need
-- the same settings sent and a plan made on every call.
--
-- ordered: a due event of an aggregate that is not held, at or after walk_start
-- (where ordered claims start walking the pending index), or a hold that expired.
-- Otherwise: any due event. The queries come from outbox-postgres `Sql` (the
-- relay's plan test checks them); changing them takes a migration that replaces
-- this function (as migration 5 does).
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
        RETURN ({{probe_due_ordered_query}});
    END IF;
    RETURN ({{probe_due_unordered_query}});
END
$$;
