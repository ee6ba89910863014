-- The function behind the opt-in LISTEN/NOTIFY wake-up. Only the function: the
-- trigger that calls it is created by outbox-postgres `install_notify_trigger`,
-- because a notifying commit serialises on a cluster-wide lock and costs
-- producers several times their throughput (see BENCHMARKS.md).
CREATE OR REPLACE FUNCTION {{notify_function}}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify({{notify_channel}}, '');
    RETURN NULL;
END
$$;
