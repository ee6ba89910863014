//! Every SQL statement of this crate, rendered once per [`Tables`] from validated names.

use uuid::Uuid;

use crate::tables::Tables;

/// Columns read into an `pgoutbox_core::Event`, in the order `row::event` decodes them.
const EVENT_COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, \
    payload::text AS payload, headers::text AS headers, destination, attempts, created_at";

/// Transaction-local setting in which an ordered claim's walk records the `seq` of
/// the first row whose aggregate lock failed (`Sql::claim_aggregates`). Set with
/// `set_config(.., true)`: it ends with the claim's transaction (pooler-safe).
const SKIPPED_FROM: &str = "pgoutbox.claim_skipped_from";

/// Planner settings for every statement on the relay's hot path, scoped to its
/// transaction (`SET LOCAL`: no session state, pooler-safe).
///
/// A queue table's statistics are wrong most of the time: analysed while empty
/// (delete-on-publish empties it), never analysed, or analysed full before a drain.
/// With wrong statistics, and under a cached generic plan (sqlx prepares every
/// statement; PostgreSQL may switch to a generic plan after five executions), the
/// planner can pick a sequential scan and a sort of the whole backlog for a claim of
/// 200 rows. With these off, the only remaining plans are the index scans the
/// statements are written for; `tests/plans.rs` checks the plans in all three
/// statistics states under `plan_cache_mode = force_generic_plan`. That mode is set
/// too: each statement is planned once per connection, never per execution (the
/// two-step ordered claim took over a millisecond to plan, more than to run). The settings
/// travel with `BEGIN` (statements outside a claim, such as the pending count, open a
/// transaction of their own with it): no extra round trip.
///
/// JIT is off as well: a plan that keeps a sequential scan anyway (the pending
/// count's look at every hold) is costed above `jit_above_cost` by the disabled
/// scan's penalty, and compiling it cost about a hundred times the statement's
/// own run (docs/benchmarks-history.md).
macro_rules! plan_guard {
    () => {
        "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
         SET LOCAL enable_sort = off; SET LOCAL plan_cache_mode = force_generic_plan; \
         SET LOCAL jit = off"
    };
}

/// What the operators' counts read of each pending event.
const STATS_COLUMNS: &str = "e.available_at, e.created_at";

/// Opens a claim transaction (simple protocol: one round trip).
pub(crate) const BEGIN: &str = concat!("BEGIN; ", plan_guard!());
/// Opens a claim transaction whose commit does not wait for the WAL flush.
pub(crate) const BEGIN_ASYNC_COMMIT: &str = concat!(
    "BEGIN; ",
    plan_guard!(),
    "; SET LOCAL synchronous_commit = off"
);

/// How long a dead letter that blocks its aggregate ([`AfterDeadLetter::Block`]) keeps
/// it held before a relay looks again. `DeadLetters::retry` and `purge` lift the
/// hold at once; this bounds the wait after a change made by hand in SQL.
const BLOCKED_RECHECK: &str = "interval '60 seconds'";

/// Events taken for an aggregate whose hold expired: the head that is due now and
/// the start of its run. The next claims find the rest through the pending index.
pub(crate) const RELEASED_RUN: i32 = 16;

/// Writes WAL messages with prefix `$1`, one per element of `$2`, emitted as the
/// scan of `unnest` yields them: in array order. `guard` (`wal::slot::guard_sql`
/// for the slot named by `$3`) fails the statement when no slot would read them.
#[cfg(feature = "wal")]
pub(crate) fn wal_emit(guard: &str) -> String {
    format!(
        "SELECT count(pg_logical_emit_message(true, $1, content)) \
         FROM unnest($2::text[]) AS m(content) WHERE {guard}"
    )
}

/// Writes WAL messages and commits, as one simple query (one round trip).
/// Parameters cannot be bound there, so prefix and contents go as escaped
/// literals. `guard` (`wal::slot::guard_sql` with the slot as a literal) comes
/// first: when it fails, the server skips the rest of the query, the commit
/// included. The trailing `BEGIN` opens an empty transaction for the caller's
/// sqlx `Transaction`, which still counts itself open, to roll back when dropped
/// (a `ROLLBACK` outside a transaction would log a warning); that `ROLLBACK` is
/// queued and sent with the connection's next statement.
#[cfg(feature = "wal")]
pub(crate) fn wal_emit_and_commit(guard: &str, prefix: &str, contents: &[String]) -> String {
    let prefix = literal(prefix);
    let mut sql = String::with_capacity(
        guard.len() + 8 + contents.iter().map(|c| c.len() + 80).sum::<usize>(),
    );
    sql.push_str("SELECT ");
    sql.push_str(guard);
    sql.push(';');
    for content in contents {
        sql.push_str("SELECT pg_logical_emit_message(true, ");
        sql.push_str(&prefix);
        sql.push_str(", ");
        sql.push_str(&literal(content));
        sql.push_str(");");
    }
    sql.push_str("COMMIT;BEGIN");
    sql
}

/// `text` as an escape-string literal (`E'...'`), read the same whatever
/// `standard_conforming_strings` says.
#[cfg(feature = "wal")]
pub(crate) fn literal(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 4);
    quoted.push_str("E'");
    for c in text.chars() {
        match c {
            '\\' => quoted.push_str("\\\\"),
            '\'' => quoted.push_str("''"),
            c => quoted.push(c),
        }
    }
    quoted.push('\'');
    quoted
}

/// The schemas whose name matches `$1` (`LIKE`) and that hold a table named `$2`:
/// the tenants' outboxes for [`crate::TenantDiscovery`].
pub(crate) const DISCOVER_SCHEMAS: &str = "SELECT n.nspname::text FROM pg_namespace n \
     JOIN pg_class c ON c.relnamespace = n.oid \
     WHERE n.nspname LIKE $1 AND c.relname = $2 AND c.relkind IN ('r', 'p') ORDER BY 1";

/// What to do with the followers of a dead-lettered event when ordering is on.
/// Deserialised from `"release"` or `"block"` (the `outbox` binary's
/// `relay.after_dead_letter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AfterDeadLetter {
    /// The next event of the aggregate becomes publishable: one poison event does not
    /// stall its aggregate, at the price of a gap (and, if the dead letter is retried
    /// later, of that event arriving after its followers).
    Release,
    /// The aggregate stays blocked until an operator retries or purges the dead letter:
    /// order is never broken, but the aggregate's later events wait. The default:
    /// a dead letter now means a message the broker refused (a broker outage makes
    /// none), and consumers of a payment's events must not see them out of order.
    #[default]
    Block,
}

/// The statements, with quoted names in place.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) create_schema: String,
    pub(crate) migrations_table: String,
    pub(crate) applied_versions: String,
    /// The migrations table, qualified (to look it up by name).
    pub(crate) migrations_name: String,
    pub(crate) record_version: String,
    /// The migrations table, quoted and qualified (for the printed script).
    pub(crate) migrations: String,
    pub(crate) migration_lock_key: String,
    pub(crate) template_names: Vec<(&'static str, String)>,

    pub(crate) claim_unordered: String,
    pub(crate) claim_aggregates: String,
    pub(crate) claim_runs: String,
    /// The relays table, qualified (see [`Sql::share_renew`]).
    relays: String,
    /// A relay's saved walk start (`$1`: ordered), unless the events' sequence
    /// has not reached it (migration 9); see [`Sql::walk_start_load`].
    walk_start_load: String,
    /// Save a relay's walk start (`$1`: ordered, `$2`: the start); see
    /// [`Sql::walk_start_save`].
    walk_start_save: String,
    /// The front and the running producers, for ordered and for unordered walks.
    pub(crate) walk_front_ordered: String,
    pub(crate) walk_front_unordered: String,
    pub(crate) hold: String,
    pub(crate) unhold: String,
    pub(crate) advance_held: String,
    pub(crate) drop_expired_holds: String,
    /// Pending events (`$1`: the walk start): those at or after the start, and
    /// those of held aggregates below it (every other event below it is
    /// published, see `walk_start.rs`). Run with [`Sql::guarded`].
    pub(crate) count_pending_ordered: String,
    pub(crate) count_pending_unordered: String,
    /// The oldest pending event below the walk start (`$1`) that no hold accounts
    /// for (put back by hand). Run with [`Sql::guarded`].
    pub(crate) look_below_ordered: String,
    pub(crate) look_below_unordered: String,
    pub(crate) delete_published: String,
    pub(crate) mark_published: String,
    pub(crate) record_failures: String,
    pub(crate) record_failures_release: String,
    pub(crate) record_failures_block: String,
    /// The wake-up probe: a call of the probe function (migrations 4 and 5); bind:
    /// ordered, walk start.
    pub(crate) probe_due: String,
    /// The probe function, qualified (see [`Sql::probe_due_simple`]).
    probe_function: String,
    /// The queries inside the probe function, with their argument, the walk start,
    /// as `$1`: what the plan test explains (and a test compares with migration 7).
    #[cfg_attr(not(feature = "test-utils"), allow(dead_code))]
    pub(crate) probe_due_ordered_query: String,
    #[cfg_attr(not(feature = "test-utils"), allow(dead_code))]
    pub(crate) probe_due_unordered_query: String,
    /// Operators' counts (`$1`: the walk start): pending, scheduled, dead letters,
    /// the oldest pending event's age, published in the last hour, held
    /// aggregates. Each read through an index, bounded by the pending, dead or
    /// recent rows, not by the table: a scan of the whole table would read every
    /// row kept for retention and, under a held snapshot, every row vacuum may not
    /// remove yet, at each refresh of the gauges. Run with [`Sql::guarded`].
    pub(crate) stats_ordered: String,
    pub(crate) stats_unordered: String,
    /// Who holds back the xmin horizon, and the oldest open producer of this outbox.
    pub(crate) horizon: String,
    pub(crate) count_due: String,
    pub(crate) count_due_unlocked: String,
    pub(crate) count_due_in_locked_aggregates: String,

    pub(crate) dead_count: String,
    pub(crate) dead_list: String,
    pub(crate) dead_retry: String,
    pub(crate) dead_purge: String,

    pub(crate) cleanup_processed: String,
    pub(crate) cleanup_inbox: String,
    pub(crate) inbox_record: String,

    /// Channel of the opt-in wake-up notifications (not quoted: `LISTEN` quotes it).
    pub(crate) notify_channel: String,
    pub(crate) create_notify_trigger: String,
    pub(crate) drop_notify_trigger: String,

    /// WAL outbox: park events of the stream in the table, in the given order:
    /// a failed one with its attempt, error and next attempt, a dead letter, or a
    /// follower waiting behind them. A re-read event parks nothing twice.
    #[cfg_attr(not(feature = "wal"), allow(dead_code))]
    pub(crate) wal_park: String,
    /// WAL outbox: whether an aggregate still has events in the table (pending or
    /// dead), which the stream's later events of it must wait behind.
    #[cfg_attr(not(feature = "wal"), allow(dead_code))]
    pub(crate) wal_parked: String,
    /// WAL outbox: every aggregate with events in the table, for a relay that
    /// starts (or reconnects) and must not let the stream overtake them.
    #[cfg_attr(not(feature = "wal"), allow(dead_code))]
    pub(crate) wal_parked_all: String,
}

/// The statements a producer runs: the inserts of [`crate::Outbox`], and nothing
/// else, so that writing an event renders two statements, not the crate's.
#[derive(Debug)]
pub(crate) struct EnqueueSql {
    pub(crate) one: String,
    pub(crate) many: String,
}

impl EnqueueSql {
    pub(crate) fn new(tables: &Tables) -> Self {
        let events = tables.qualify(tables.events());
        Self {
            one: format!(
                "INSERT INTO {events} (id, aggregate_type, aggregate_id, event_type, payload, \
             headers, destination, available_at) \
             VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, COALESCE($8, now()))"
            ),
            many: format!(
                "INSERT INTO {events} (id, aggregate_type, aggregate_id, event_type, payload, \
             headers, destination, available_at) \
             SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::jsonb, \
             u.headers::jsonb, u.destination, COALESCE(u.available_at, now()) \
             FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], \
             $6::text[], $7::text[], $8::timestamptz[]) WITH ORDINALITY \
             AS u(id, aggregate_type, aggregate_id, event_type, payload, headers, \
             destination, available_at, n) ORDER BY u.n"
            ),
        }
    }
}

impl Sql {
    pub(crate) fn new(tables: &Tables) -> Self {
        let events = tables.qualify(tables.events());
        let inbox = tables.qualify(tables.inbox());
        let migrations = format!(
            "{}.{}",
            tables.schema().quoted(),
            tables.derived(tables.events(), "migrations")
        );
        let pending = "processed_at IS NULL AND dead_at IS NULL";
        // Unique per events table; identifiers are validated ([a-z0-9_]), so it is
        // safe as a string literal too.
        let mut notify_channel = format!("{}.{}", tables.schema(), tables.events());
        notify_channel.truncate(crate::ident::MAX_IDENT_LEN);
        let notify_function = format!(
            "{}.{}",
            tables.schema().quoted(),
            tables.derived(tables.events(), "notify")
        );
        let notify_trigger = tables.derived(tables.events(), "notify");
        // The event columns, qualified: the lateral join of `claim_runs` has
        // aggregate columns on both sides.
        let run_columns = EVENT_COLUMNS
            .split(", ")
            .map(|c| format!("e.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        // When a row is not due: its `available_at`, else NULL. A claim's rows are
        // almost always due, and a NULL costs the relay nothing to decode (a
        // timestamp and a flag per row did). Due as of the clock, not `now()`: the
        // claim's transaction began before its statement took its snapshot, and a
        // producer that began in between and committed before the snapshot wrote an
        // `available_at` (its own `now()`) later than the claim's `now()`. Its event
        // looked not due, and its aggregate got a hold that the next claim took up
        // and deleted: a write to the holds table for a few percent of the events,
        // whose dead versions every claim and probe stepped over while a snapshot
        // was held elsewhere. A visible row committed before the snapshot, so its
        // producer's `now()` is never later than the clock.
        let waits_until = |alias: &str| {
            format!(
                "CASE WHEN {alias}.available_at > clock_timestamp() THEN {alias}.available_at \
                 END AS waits_until"
            )
        };
        let waits_until_w = waits_until("w");
        // The ordered walk's record of its first failed lock; NULL until one fails
        // (a setting set once in the session reads '' after its transaction).
        let skipped_from = format!("NULLIF(current_setting('{SKIPPED_FROM}', true), '')");
        let waits_until_e = waits_until("e");
        // The held aggregates (migration 7; migration 3 created it as `<events>_holds`).
        let holds = format!(
            "{}.{}",
            tables.schema().quoted(),
            tables.derived(tables.events(), "held")
        );
        let relays = format!(
            "{}.{}",
            tables.schema().quoted(),
            tables.derived(tables.events(), "relays")
        );
        let walk_starts = format!(
            "{}.{}",
            tables.schema().quoted(),
            tables.derived(tables.events(), "walk_starts")
        );
        // Advisory-lock key of one aggregate of this outbox: the two-int4 form, in a
        // key space of its own (objsubid 2), class = hash of the table name, so that
        // outboxes do not share locks. Colliding aggregates share a lock: less
        // parallelism, never less order.
        let lock_class = format!("hashtext('{}.{}')", tables.schema(), tables.events());
        let lock_key = |alias: &str| {
            format!("hashtext({alias}.aggregate_type || ' ' || {alias}.aggregate_id)")
        };
        let lock = |alias: &str| {
            format!(
                "pg_try_advisory_xact_lock({lock_class}, {})",
                lock_key(alias)
            )
        };
        // Whether a row's aggregate is outside the claim's share ($5 of $6 shares,
        // `shares.rs`); never when $5 is NULL. Shares split the lock keys, so all
        // of an aggregate's rows are in one share.
        let outside_share = |alias: &str| {
            format!(
                "$5::int4 IS NOT NULL AND ({} & 2147483647) % $6::int4 <> $5::int4",
                lock_key(alias)
            )
        };
        // Most of the time nothing is held: one look at the holds table per statement
        // (an init plan) then spares every row its primary-key probe. `OFFSET 0`
        // keeps the probe a probe: without it the planner may hash the whole holds
        // table instead, once per statement (it does under a generic plan when the
        // table was analysed while empty), and a claim costs O(holds), over twenty
        // times the probe's cost with 20,000 aggregates held by a long partial outage
        // (docs/benchmarks-history.md).
        let not_held = |alias: &str| {
            format!(
                "(NOT EXISTS (SELECT 1 FROM {holds}) OR NOT EXISTS (SELECT 1 FROM {holds} h \
                 WHERE h.aggregate_type = {alias}.aggregate_type \
                 AND h.aggregate_id = {alias}.aggregate_id OFFSET 0))"
            )
        };
        // The `= ANY` repeats the join's condition, so that the events table is
        // read by those ids whichever way the join is planned (on a table vacuumed
        // after a drain, the planner took it for empty and merged the ids with a
        // read of the whole primary key, entries of published events included).
        let failures = "UPDATE {events} e SET attempts = e.attempts + 1, last_error = f.error, \
             available_at = clock_timestamp() + f.delay_ms * interval '1 millisecond', \
             dead_at = CASE WHEN f.dead THEN clock_timestamp() END \
             FROM unnest($1::uuid[], $2::text[], $3::float8[], $4::bool[]) \
             AS f(id, error, delay_ms, dead) WHERE e.id = f.id AND e.id = ANY($1)"
            .replace("{events}", &events);
        // A hold's `from_seq` when two bounds meet: the lower, NULL (from the
        // aggregate's oldest event) if either is.
        let lower_bound = |a: &str, b: &str| {
            format!("CASE WHEN {a} IS NULL OR {b} IS NULL THEN NULL ELSE LEAST({a}, {b}) END")
        };
        let keep_lower_bound = format!(
            "from_seq = {}",
            lower_bound("h.from_seq", "EXCLUDED.from_seq")
        );
        // With ordering on, a failed event holds its aggregate until it is due again
        // (or, blocking dead letters, until the recheck); the relay held back its
        // followers in the same batch. The hold's `from_seq`: the failed event, or
        // the claim's walk start ($5) if lower, below which every event that will
        // ever commit had committed when the claim began (`walk_start.rs`), so that
        // a producer of the aggregate that commits late is still found.
        let failures_holding = |dead_until: &str| {
            format!(
                "WITH f AS ({failures} RETURNING e.seq, e.aggregate_type, e.aggregate_id, \
                 e.available_at, e.dead_at) \
                 INSERT INTO {holds} AS h (aggregate_type, aggregate_id, until, from_seq) \
                 SELECT aggregate_type, aggregate_id, \
                 max(CASE WHEN dead_at IS NULL THEN available_at ELSE {dead_until} END), \
                 LEAST(min(seq), $5::int8) \
                 FROM f GROUP BY aggregate_type, aggregate_id \
                 HAVING max(CASE WHEN dead_at IS NULL THEN available_at ELSE {dead_until} END) IS NOT NULL \
                 ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET until = EXCLUDED.until, \
                 {keep_lower_bound}"
            )
        };
        // Filters of the ordered probe: a due event of an aggregate not held, or a
        // hold that expired. Followers of a held aggregate do not wake the relay.
        // The first due event in `seq` order, not `EXISTS`: the planner drops the
        // order of an `EXISTS` subquery, and then may pick the aggregate index
        // (its predicate fits too) and read all of it for `seq >= start`, dead
        // entries included; ordered, only the pending index serves it (sorts are
        // off), from the start.
        let probe_ordered = |walk_start: &str| {
            format!(
                "SELECT (SELECT e.seq FROM {events} e WHERE e.processed_at IS NULL \
                 AND e.dead_at IS NULL AND e.seq >= {walk_start} \
                 AND e.available_at <= now() AND {} ORDER BY e.seq LIMIT 1) IS NOT NULL \
                 OR EXISTS (SELECT 1 FROM {holds} WHERE until <= now())",
                not_held("e")
            )
        };
        let probe_unordered = |walk_start: &str| {
            format!(
                "SELECT (SELECT seq FROM {events} WHERE processed_at IS NULL AND dead_at IS NULL \
                 AND seq >= {walk_start} AND available_at <= now() ORDER BY seq LIMIT 1) IS NOT NULL"
            )
        };
        // The pending events (`$1`: the walk start), each row `columns` of one: those
        // at or after the start and, ordered, those of held aggregates below it (every
        // other event below it is published, see `walk_start.rs`). In `seq` order for
        // the same reason as the probe. `OFFSET 0` keeps a held aggregate's events a
        // probe per hold: pulled up into a join, the planner may read the aggregate
        // index whole for `seq < start`.
        let pending_unordered = |columns: &str| {
            format!(
                "SELECT {columns} FROM {events} e WHERE {pending} AND e.seq >= $1 \
                 ORDER BY e.seq"
            )
        };
        let pending_ordered = |columns: &str| {
            format!(
                "({}) UNION ALL SELECT b.* FROM {holds} h CROSS JOIN LATERAL \
                 (SELECT {columns} FROM {events} e \
                 WHERE e.aggregate_type = h.aggregate_type AND e.aggregate_id = h.aggregate_id \
                 AND e.processed_at IS NULL AND e.dead_at IS NULL AND e.seq < $1 \
                 AND e.seq >= COALESCE(h.from_seq, '-9223372036854775808'::int8) OFFSET 0) b",
                pending_unordered(columns)
            )
        };
        // The operators' counts over `rows` (the pending events, as the relay counts
        // them) and the dead letters, recent publications and holds, each from its
        // own index.
        let stats = |rows: &str| {
            format!(
                "SELECT count(*), count(*) FILTER (WHERE p.available_at > now()), \
                 (SELECT count(*) FROM {events} WHERE dead_at IS NOT NULL AND processed_at IS NULL), \
                 COALESCE(extract(epoch FROM now() - min(p.created_at)), 0)::float8, \
                 (SELECT count(*) FROM {events} WHERE processed_at > now() - interval '1 hour'), \
                 (SELECT count(*) FROM {holds}) \
                 FROM ({rows}) p"
            )
        };
        let probe_function = format!(
            "{}.{}",
            tables.schema().quoted(),
            tables.derived(tables.events(), "probe_due")
        );
        // Producers that may still commit an event numbered below a front: the
        // transactions holding a lock on the events table's identity sequence.
        // `nextval` takes one (RowExclusiveLock) before it hands out a number and
        // keeps it to the end of the transaction, so a producer is listed from the
        // moment it has a `seq`; a prepared transaction keeps its locks too (listed
        // as `-1/<xid>`). A session that holds a snapshot but writes no events
        // (pg_dump, a report, an idle client) is not listed: waiting for it kept the
        // start in place for as long as it ran, and every claim stepped over the
        // index entries of the events published meanwhile, which vacuum cannot
        // remove while that snapshot exists. A table without an owned sequence (not
        // made by `migrate`) lists every transaction instead.
        let sequence = format!("pg_get_serial_sequence('{events}', 'seq')::regclass::oid");
        let walk_front = |filter: &str, expired_holds: &str| {
            format!(
                "SELECT (SELECT f.seq FROM {events} f WHERE f.processed_at IS NULL \
                 AND f.dead_at IS NULL AND f.seq >= $1{filter} ORDER BY f.seq LIMIT 1) AS front, \
                 ARRAY(SELECT l.virtualtransaction FROM pg_locks l \
                 CROSS JOIN (SELECT {sequence} AS oid) s \
                 WHERE l.pid IS DISTINCT FROM pg_backend_pid() AND CASE WHEN s.oid IS NULL \
                 THEN l.locktype = 'virtualxid' \
                 ELSE l.locktype = 'relation' AND l.relation = s.oid AND l.database = \
                 (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) END \
                 UNION ALL SELECT 'prepared ' || p.transaction::text FROM pg_prepared_xacts p \
                 WHERE {sequence} IS NULL) AS running, {expired_holds} AS expired_holds"
            )
        };
        // Dead-letter administration: an expired hold, read from the aggregate's
        // oldest event, for each aggregate of the rows `r` changed.
        let expire_holds = format!(
            "INSERT INTO {holds} (aggregate_type, aggregate_id, until, from_seq) \
             SELECT DISTINCT aggregate_type, aggregate_id, now(), NULL::int8 FROM r \
             ON CONFLICT (aggregate_type, aggregate_id) \
             DO UPDATE SET until = EXCLUDED.until, from_seq = NULL"
        );
        // Filters shared by the dead-letter statements; NULL parameters match everything.
        let dead = "dead_at IS NOT NULL AND processed_at IS NULL \
             AND ($1::text IS NULL OR event_type = $1) \
             AND ($2::text IS NULL OR aggregate_type = $2) \
             AND ($3::text IS NULL OR aggregate_id = $3) \
             AND ($4::float8 IS NULL OR dead_at < now() - $4 * interval '1 second') \
             AND ($5::uuid[] IS NULL OR id = ANY($5)) \
             AND ($6::text IS NULL OR strpos(lower(last_error), lower($6)) > 0)";
        Self {
            create_schema: format!("CREATE SCHEMA IF NOT EXISTS {}", tables.schema().quoted()),
            migrations_table: format!(
                "CREATE TABLE IF NOT EXISTS {migrations} (version integer PRIMARY KEY, \
                 name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            ),
            applied_versions: format!("SELECT version FROM {migrations}"),
            migrations_name: migrations.clone(),
            record_version: format!("INSERT INTO {migrations} (version, name) VALUES ($1, $2)"),
            migrations: migrations.clone(),
            migration_lock_key: format!("outbox.migrate:{events}"),
            template_names: vec![
                ("events", events.clone()),
                ("events_pkey", tables.derived(tables.events(), "pkey")),
                ("events_pending_idx", tables.derived(tables.events(), "pending_idx")),
                ("events_aggregate_idx", tables.derived(tables.events(), "aggregate_idx")),
                ("events_dead_idx", tables.derived(tables.events(), "dead_idx")),
                ("events_processed_idx", tables.derived(tables.events(), "processed_idx")),
                ("dead_letters", tables.qualify(tables.dead_letters())),
                ("inbox", inbox.clone()),
                ("inbox_pkey", tables.derived(tables.inbox(), "pkey")),
                ("inbox_processed_idx", tables.derived(tables.inbox(), "processed_idx")),
                ("notify_function", notify_function.clone()),
                ("schema", tables.schema().quoted()),
                (
                    "holds",
                    format!(
                        "{}.{}",
                        tables.schema().quoted(),
                        tables.derived(tables.events(), "holds")
                    ),
                ),
                ("holds_pkey", tables.derived(tables.events(), "holds_pkey")),
                ("holds_until_idx", tables.derived(tables.events(), "holds_until_idx")),
                ("held", holds.clone()),
                ("held_table", tables.derived(tables.events(), "held")),
                ("held_pkey", tables.derived(tables.events(), "held_pkey")),
                ("held_until_idx", tables.derived(tables.events(), "held_until_idx")),
                ("relays", relays.clone()),
                ("relays_pkey", tables.derived(tables.events(), "relays_pkey")),
                ("walk_starts", walk_starts.clone()),
                ("walk_starts_pkey", tables.derived(tables.events(), "walk_starts_pkey")),
                ("notify_channel", format!("'{notify_channel}'")),
                ("probe_function", probe_function.clone()),
                // Migration 8: writers in any language (plain SQL).
                ("events_headers_check", tables.derived(tables.events(), "headers_check")),
                ("emit_function", tables.emit_function()),
                ("emit_check_function", tables.emit_check_function()),
                // Identifiers are validated ([a-z0-9_]): safe in a string literal.
                ("wal_prefix", format!("'pgoutbox:{}'", tables.outbox_name())),
            ],

            // From the walk start ($2), as ordered claims walk; due as of the clock,
            // as `waits_until` says why.
            claim_unordered: format!(
                "SELECT {EVENT_COLUMNS} FROM {events} e \
                 WHERE e.processed_at IS NULL AND e.dead_at IS NULL AND e.seq >= $2 \
                 AND e.available_at <= clock_timestamp() \
                 ORDER BY e.seq LIMIT $1 FOR UPDATE SKIP LOCKED"
            ),
            // Ordered claim, step 1: walk the pending index in insertion order from
            // `seq` $4 (the walk start, see `walk_start.rs`), at most $2 rows,
            // skipping held aggregates; try-lock each row's aggregate (re-entrant:
            // every row of an aggregate this claim locked passes; rows of aggregates
            // other relays hold fail) and keep the first $1 rows that pass. With a
            // share ($5 of $6, `shares.rs`), rows of aggregates outside it are walked
            // (they count towards $2, so an empty share costs a bounded walk) but
            // neither locked nor kept: no failed lock, no probe. Plus a
            // row carrying the `seq` of the first row whose lock failed, if one did
            // (`skipped_from`), and up to $3 expired holds, locked, as rows with
            // `held` set and no event columns.
            //
            // The rows are read with the statement's snapshot, taken before the locks.
            // For an aggregate, they are what a read after its lock would return
            // unless another transaction changed it in between, and that leaves one
            // of two traces, checked per aggregate:
            // - a kept row someone deleted, updated or locked (`clean` false: the
            //   row has an xmax). The xmax is read in the index scan itself, in the
            //   branch of the expression that took the lock, so after it: the scan's
            //   tuple is the row in the shared buffer (pinned, so it stays in place),
            //   where a relay that held the aggregate and committed between our read
            //   and our lock has set its xmax. `tests/plans.rs` checks that the plan
            //   evaluates the lock and the xmax in the scan node.
            // - a lock on the aggregate that failed on an earlier row: its holder let
            //   go during the walk, and may have left the aggregate in any state
            //   (a published run, a hold, rows it never took still pending before
            //   ours). The walk records the `seq` of the first row whose lock failed
            //   in a transaction-local setting; from then on, each kept row carries
            //   `skipped_before`: whether its aggregate has a pending row between
            //   that `seq` and the row (one probe of the aggregate index, in the same
            //   snapshot). On an aggregate's first kept row that is exactly "a row of
            //   this aggregate was walked and not kept": its lock failed (rows before
            //   the first failure were all kept). The dead-letter filter is left out
            //   so that only the aggregate index can serve the probe (a dead letter
            //   there makes the store read the aggregate again: safe). The setting
            //   is read back by the statement's next `UNION ALL` part, which runs
            //   once the walk is done, for the re-read's start.
            // Aggregates with a trace are read again by the store (step 2); the rows
            // of all others are used as they are.
            // Not-due rows are walked too, so a run never starts behind a head that
            // waits. Every column of a walked row is passed up by reference; only
            // kept rows have their JSON formatted.
            //
            // An earlier form numbered the walked rows with a window function and
            // fetched each kept row again by `ctid` for its xmax: the same traces,
            // at a cost per event (docs/benchmarks-history.md, "Claim path").
            claim_aggregates: format!(
                "(SELECT w.seq, w.id, w.aggregate_type, w.aggregate_id, w.event_type, \
                 w.payload::text AS payload, w.headers::text AS headers, w.destination, \
                 w.attempts, w.created_at, {waits_until_w}, w.clean, \
                 CASE WHEN {skipped_from} IS NOT NULL THEN EXISTS (SELECT 1 FROM {events} f \
                 WHERE f.aggregate_type = w.aggregate_type AND f.aggregate_id = w.aggregate_id \
                 AND f.processed_at IS NULL AND f.seq >= {skipped_from}::int8 AND f.seq < w.seq) \
                 END AS skipped_before, false AS held, NULL::int8 AS skipped_from \
                 FROM (SELECT e.seq, e.id, e.aggregate_type, e.aggregate_id, e.event_type, \
                 e.payload, e.headers, e.destination, e.attempts, e.created_at, e.available_at, \
                 CASE WHEN {} THEN NULL \
                 WHEN {} THEN e.xmax = 0 \
                 WHEN {skipped_from} IS NOT NULL THEN NULL \
                 WHEN set_config('{SKIPPED_FROM}', e.seq::text, true) IS NULL THEN NULL \
                 END AS clean \
                 FROM {events} e \
                 WHERE e.processed_at IS NULL AND e.dead_at IS NULL AND e.seq >= $4 AND {} \
                 ORDER BY e.seq LIMIT $2) w \
                 WHERE w.clean IS NOT NULL LIMIT $1) \
                 UNION ALL \
                 (SELECT NULL::int8, NULL::uuid, NULL::text, NULL::text, NULL::text, \
                 NULL::text, NULL::text, NULL::text, NULL::int4, NULL::timestamptz, \
                 NULL::timestamptz, NULL::bool, NULL::bool, false, \
                 {skipped_from}::int8 WHERE {skipped_from} IS NOT NULL) \
                 UNION ALL \
                 (SELECT x.from_seq, NULL::uuid, x.aggregate_type, x.aggregate_id, NULL::text, \
                 NULL::text, NULL::text, NULL::text, NULL::int4, NULL::timestamptz, \
                 NULL::timestamptz, NULL::bool, NULL::bool, true, NULL::int8 \
                 FROM (SELECT aggregate_type, aggregate_id, from_seq FROM {holds} \
                 WHERE until <= now() ORDER BY until LIMIT $3) x WHERE {})",
                outside_share("e"),
                lock("e"),
                not_held("e"),
                lock("x"),
            ),
            // Step 2, for the aggregates in which step 1 saw a trace of a change, and
            // for expired holds: a new statement and so a snapshot taken after the
            // locks: whatever another relay did to these aggregates before it let go
            // is visible, its holds included. Those aggregates' pending events
            // between `from_seq` ($3) and the newest row step 1 kept ($4), one probe of
            // the aggregate index per aggregate: a fenced lateral subquery whose
            // filter leaves dead letters in (flagged; the store steps over them or
            // stops at them as for expired holds), so that only the aggregate index's
            // predicate holds and the pending index cannot serve it. A generic plan
            // without statistics otherwise scanned the whole seq range once per key,
            // a claim's cost growing with the backlog. Held aggregates are left out
            // by the walk's own check (`not_held`: one probe of the holds table per
            // key). Then each expired hold's first $8 events from its `from_seq` ($7;
            // the store passes i64::MIN for NULL), through the aggregate index: never
            // below it, where the index keeps the entries of the aggregate's
            // published events until vacuum removes them.
            // Not-due rows and dead letters come back flagged; the store ends each
            // run before a not-due row and steps over (Release) or stops at (Block)
            // a dead letter.
            claim_runs: format!(
                "SELECT r.* FROM unnest($1::text[], $2::text[]) AS k(aggregate_type, aggregate_id) \
                 CROSS JOIN LATERAL (SELECT {run_columns}, {waits_until_e}, \
                 e.dead_at IS NOT NULL AS dead FROM {events} e \
                 WHERE e.aggregate_type = k.aggregate_type AND e.aggregate_id = k.aggregate_id \
                 AND e.processed_at IS NULL AND e.seq >= $3 AND e.seq <= $4 \
                 ORDER BY e.seq OFFSET 0) r \
                 WHERE {} \
                 UNION ALL \
                 SELECT r.* FROM unnest($5::text[], $6::text[], $7::int8[]) \
                 AS k(aggregate_type, aggregate_id, from_seq) \
                 CROSS JOIN LATERAL (SELECT {run_columns}, {waits_until_e}, \
                 e.dead_at IS NOT NULL AS dead \
                 FROM {events} e WHERE e.aggregate_type = k.aggregate_type \
                 AND e.aggregate_id = k.aggregate_id AND e.processed_at IS NULL \
                 AND e.seq >= k.from_seq ORDER BY e.seq LIMIT $8) r",
                not_held("k"),
            ),
            relays: relays.clone(),
            // A saved start above the sequence's last value was saved before the
            // table's identity was restarted: walks would skip every new event.
            walk_start_load: format!(
                "SELECT w.from_seq FROM {walk_starts} w WHERE w.ordered = $1 \
                 AND w.from_seq <= COALESCE(pg_sequence_last_value({sequence}), 0)"
            ),
            // Whichever relay saved last: every start a relay adopted stays valid
            // (`walk_start.rs`), a lower one is only less far on.
            walk_start_save: format!(
                "INSERT INTO {walk_starts} AS w (ordered, from_seq, saved_at) \
                 VALUES ($1, $2, now()) ON CONFLICT (ordered) \
                 DO UPDATE SET from_seq = EXCLUDED.from_seq, saved_at = EXCLUDED.saved_at"
            ),
            // What moves the walk start (`walk_start.rs`): the oldest pending event at
            // or after $1 that a walk must see (ordered: of an aggregate not held;
            // held and not-due events included otherwise), as this statement's
            // snapshot sees it; and the producers running once that snapshot was
            // taken.
            walk_front_ordered: walk_front(&format!(" AND {}", not_held("f")), "false"),
            // Unordered relays keep no holds, but `DeadLetters::retry` writes an
            // expired one for each retried event, which it puts back below where
            // walks start: the relay then walks from the beginning once and
            // deletes them (`drop_expired_holds`).
            walk_front_unordered: walk_front(
                "",
                &format!("EXISTS (SELECT 1 FROM {holds} WHERE until <= now())"),
            ),
            drop_expired_holds: format!("DELETE FROM {holds} WHERE until <= now()"),
            // NULL until: a blocking dead letter, looked at again after the recheck.
            // `from_seq` ($4) only ever goes down here (see migration 7).
            hold: format!(
                "INSERT INTO {holds} AS h (aggregate_type, aggregate_id, until, from_seq) \
                 SELECT t, i, COALESCE(u, clock_timestamp() + {BLOCKED_RECHECK}), f \
                 FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::int8[]) \
                 AS x(t, i, u, f) \
                 ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET until = EXCLUDED.until, \
                 {keep_lower_bound}"
            ),
            // An expired hold taken up by a claim that published the start of its
            // aggregate's events: the rest are read from `from_seq` ($3) next time.
            advance_held: format!(
                "UPDATE {holds} h SET from_seq = u.f \
                 FROM unnest($1::text[], $2::text[], $3::int8[]) AS u(t, i, f) \
                 WHERE h.aggregate_type = u.t AND h.aggregate_id = u.i \
                 AND h.aggregate_type = ANY($1) AND h.aggregate_id = ANY($2)"
            ),
            // The `= ANY` conditions repeat the join's: whichever side the planner
            // puts the holds table on, its scan is bounded by the keys given, not a
            // read of every hold (a generic plan on a holds table analysed while
            // empty scans it whole, as the outer side, otherwise).
            unhold: format!(
                "DELETE FROM {holds} h USING unnest($1::text[], $2::text[]) AS u(t, i) \
                 WHERE h.aggregate_type = u.t AND h.aggregate_id = u.i \
                 AND h.aggregate_type = ANY($1) AND h.aggregate_id = ANY($2)"
            ),
            delete_published: format!("DELETE FROM {events} WHERE id = ANY($1)"),
            mark_published: format!(
                "UPDATE {events} SET processed_at = clock_timestamp(), attempts = attempts + 1 \
                 WHERE id = ANY($1)"
            ),
            record_failures_release: failures_holding("NULL::timestamptz"),
            record_failures_block: failures_holding(&format!(
                "clock_timestamp() + {BLOCKED_RECHECK}"
            )),
            record_failures: failures,
            count_pending_ordered: format!("SELECT count(*) FROM ({}) p", pending_ordered("1")),
            count_pending_unordered: format!("SELECT count(*) FROM ({}) p", pending_unordered("1")),
            look_below_ordered: format!(
                "SELECT f.seq FROM {events} f WHERE f.processed_at IS NULL AND f.dead_at IS NULL \
                 AND f.seq < $1 AND {} ORDER BY f.seq LIMIT 1",
                not_held("f")
            ),
            look_below_unordered: format!(
                "SELECT seq FROM {events} WHERE {pending} AND seq < $1 ORDER BY seq LIMIT 1"
            ),
            probe_due: format!("SELECT {probe_function}($1, $2)"),
            probe_function: probe_function.clone(),
            probe_due_ordered_query: probe_ordered("$1"),
            probe_due_unordered_query: probe_unordered("$1"),
            stats_ordered: stats(&pending_ordered(STATS_COLUMNS)),
            stats_unordered: stats(&pending_unordered(STATS_COLUMNS)),

            // Sessions of the cluster holding a snapshot (other than this one), by
            // the age of their xmin: the oldest, its transaction's age, and who it
            // is; the oldest xmin of any kind (replication slots, a replica's
            // feedback through its walsender, prepared transactions) in
            // transactions; and the age of the oldest transaction that took a
            // `seq` of this outbox and is still open (it keeps walk starts below
            // its event, `walk_start.rs`). Other roles' sessions show only with
            // `pg_read_all_stats` (e.g. the `pg_monitor` role).
            horizon: format!(
                "WITH s AS (SELECT pid, backend_xmin, xact_start, state, backend_type, \
                 application_name FROM pg_stat_activity \
                 WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()), \
                 o AS (SELECT * FROM s ORDER BY age(backend_xmin) DESC LIMIT 1) \
                 SELECT (SELECT extract(epoch FROM now() - min(xact_start)) FROM s)::float8 \
                 AS snapshot_age, \
                 (SELECT format('pid %s (%s, %s)', pid, \
                 COALESCE(NULLIF(application_name, ''), backend_type), COALESCE(state, '?')) \
                 FROM o) AS holder, \
                 GREATEST((SELECT max(age(backend_xmin)) FROM s), \
                 (SELECT max(age(xmin)) FROM pg_replication_slots), \
                 (SELECT max(age(transaction)) FROM pg_prepared_xacts))::int8 AS xmin_age, \
                 (SELECT extract(epoch FROM now() - min(a.xact_start)) FROM pg_locks l \
                 JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'relation' \
                 AND l.relation = {sequence} AND l.pid <> pg_backend_pid())::float8 \
                 AS producer_age"
            ),
            count_due: format!(
                "SELECT count(*) FROM (SELECT 1 FROM {events} \
                 WHERE {pending} AND available_at <= now() LIMIT $1) d"
            ),
            // Ordered claims lock aggregates, not rows: due events whose aggregate's
            // advisory lock someone holds (read from pg_locks, nothing is taken).
            count_due_in_locked_aggregates: format!(
                "SELECT count(*) FROM (SELECT aggregate_type, aggregate_id FROM {events} \
                 WHERE {pending} AND available_at <= now() LIMIT $1) d \
                 WHERE ({lock_class}::oid, hashtext(d.aggregate_type || ' ' || d.aggregate_id)::oid) \
                 IN (SELECT classid, objid FROM pg_locks \
                 WHERE locktype = 'advisory' AND objsubid = 2 AND granted)"
            ),
            // FOR KEY SHARE conflicts with the unordered relays' FOR UPDATE: locked
            // rows are skipped.
            count_due_unlocked: format!(
                "SELECT count(*) FROM (SELECT 1 FROM {events} \
                 WHERE {pending} AND available_at <= now() LIMIT $1 FOR KEY SHARE SKIP LOCKED) f"
            ),
            dead_count: format!("SELECT count(*) FROM {events} WHERE {dead}"),
            // $8: a page's cursor, the last dead letter of the previous page (its
            // `seq`, looked up by id, so callers need not know the column).
            dead_list: format!(
                "SELECT {EVENT_COLUMNS}, last_error, dead_at FROM {events} WHERE {dead} \
                 AND ($8::uuid IS NULL OR seq > (SELECT c.seq FROM {events} c WHERE c.id = $8)) \
                 ORDER BY seq LIMIT $7"
            ),
            // A retried dead letter goes back into the pending index below where
            // ordered walks may start now (`walk_start.rs`), so its aggregate gets a
            // hold that has already expired: the next ordered claim takes the
            // aggregate up from its oldest event through the aggregate index, the
            // retried dead letter first (it has the lowest seq), before its followers.
            dead_retry: format!(
                "WITH r AS (UPDATE {events} SET dead_at = NULL, attempts = 0, available_at = now() \
                 WHERE {dead} RETURNING aggregate_type, aggregate_id), \
                 u AS ({expire_holds}) \
                 SELECT count(*) FROM r"
            ),
            // Expires the holds of the aggregates it touches, so a blocked aggregate
            // moves at once: the next claim takes it up from its oldest event (its
            // followers may lie below where walks start; a hold is only deleted by
            // a claim that publishes all of its aggregate's events).
            dead_purge: format!(
                "WITH r AS (DELETE FROM {events} WHERE {dead} RETURNING aggregate_type, aggregate_id), \
                 u AS ({expire_holds}) \
                 SELECT count(*) FROM r"
            ),

            // Cleanup: the oldest `$2` rows older than `$1` seconds, from `$3` on (the
            // newest `processed_at` the previous batch deleted, see `cleanup.rs`);
            // how many, and the newest `processed_at` among them.
            cleanup_processed: format!(
                "WITH d AS (DELETE FROM {events} WHERE id IN (SELECT id FROM {events} \
                 WHERE processed_at < now() - $1 * interval '1 second' AND processed_at >= COALESCE($3::timestamptz, '-infinity') \
                 ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING processed_at) \
                 SELECT count(*), max(processed_at) FROM d"
            ),
            cleanup_inbox: format!(
                "WITH d AS (DELETE FROM {inbox} WHERE (consumer, event_id) IN \
                 (SELECT consumer, event_id FROM {inbox} \
                 WHERE processed_at < now() - $1 * interval '1 second' AND processed_at >= COALESCE($3::timestamptz, '-infinity') \
                 ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING processed_at) \
                 SELECT count(*), max(processed_at) FROM d"
            ),
            inbox_record: format!(
                "INSERT INTO {inbox} (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            ),

            // Per statement: one notification per enqueue or enqueue_many call.
            create_notify_trigger: format!(
                "CREATE TRIGGER {notify_trigger} AFTER INSERT ON {events} \
                 FOR EACH STATEMENT EXECUTE FUNCTION {notify_function}()"
            ),
            drop_notify_trigger: format!("DROP TRIGGER IF EXISTS {notify_trigger} ON {events}"),
            notify_channel,

            wal_park: format!(
                "INSERT INTO {events} (id, aggregate_type, aggregate_id, event_type, payload, \
                 headers, destination, created_at, attempts, available_at, dead_at, last_error) \
                 SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::jsonb, \
                 u.headers::jsonb, u.destination, u.created_at, u.attempts, \
                 now() + u.delay_ms * interval '1 millisecond', \
                 CASE WHEN u.dead THEN now() END, u.last_error \
                 FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], \
                 $6::text[], $7::text[], $8::timestamptz[], $9::int[], $10::bigint[], \
                 $11::bool[], $12::text[]) WITH ORDINALITY \
                 AS u(id, aggregate_type, aggregate_id, event_type, payload, headers, \
                 destination, created_at, attempts, delay_ms, dead, last_error, n) \
                 ORDER BY u.n ON CONFLICT (id) DO NOTHING"
            ),
            wal_parked: format!(
                "SELECT EXISTS (SELECT 1 FROM {events} \
                 WHERE aggregate_type = $1 AND aggregate_id = $2 AND processed_at IS NULL)"
            ),
            wal_parked_all: format!(
                "SELECT DISTINCT aggregate_type, aggregate_id FROM {events} \
                 WHERE processed_at IS NULL"
            ),
        }
    }

    /// `statement` with the walk start written in for `$1`, after the planner
    /// settings of [`BEGIN`], as one simple query: one round trip, in the implicit
    /// transaction PostgreSQL runs a multi-statement query in, so `SET LOCAL` ends
    /// with it (pooler-safe outside a transaction, see `pooler.rs`).
    pub(crate) fn guarded(statement: &str, walk_start: i64) -> String {
        format!(
            "{}; {}",
            plan_guard!(),
            statement.replace("$1", &format!("'{walk_start}'::int8"))
        )
    }

    /// The saved walk start of ordered or unordered relays, with the argument
    /// written in: a simple query, pooler-safe outside a transaction
    /// (`pooler.rs`), as the relay runs it once on its pool.
    pub(crate) fn walk_start_load(&self, ordered: bool) -> String {
        self.walk_start_load.replace("$1", &ordered.to_string())
    }

    /// Save `from` as the walk start of ordered or unordered relays, as a simple
    /// query (see [`Sql::walk_start_load`]).
    pub(crate) fn walk_start_save(&self, ordered: bool, from: i64) -> String {
        self.walk_start_save
            .replace("$1", &ordered.to_string())
            .replace("$2", &format!("'{from}'::int8"))
    }

    /// The wake-up probe with its arguments written in, for the simple protocol
    /// (one round trip: pooler-safe outside a transaction, see `pooler.rs`).
    pub(crate) fn probe_due_simple(&self, ordered: bool, walk_start: i64) -> String {
        format!("SELECT {}", self.probe_due_call(ordered, walk_start))
    }

    /// The probe function's call with its arguments written in, an expression
    /// (the shared wake-up asks many outboxes' in one `SELECT`).
    pub(crate) fn probe_due_call(&self, ordered: bool, walk_start: i64) -> String {
        format!("{}({ordered}, {walk_start})", self.probe_function)
    }

    /// Shares of a backlog (`shares.rs`): record `relay` as seen now and return
    /// the other relays seen within `expiry_ms`. Rows of relays not seen for a
    /// minute are deleted on the way (a relay whose share ends deletes its own).
    /// One simple query, arguments written in (a UUID and a number): pooler-safe
    /// outside a transaction (see `pooler.rs`).
    pub(crate) fn share_renew(&self, relay: Uuid, expiry_ms: u64) -> String {
        let relays = &self.relays;
        format!(
            "WITH gone AS (DELETE FROM {relays} \
             WHERE seen_at < clock_timestamp() - interval '1 minute'), \
             seen AS (INSERT INTO {relays} (relay, seen_at) \
             VALUES ('{relay}'::uuid, clock_timestamp()) \
             ON CONFLICT (relay) DO UPDATE SET seen_at = EXCLUDED.seen_at) \
             SELECT relay FROM {relays} \
             WHERE seen_at > clock_timestamp() - {expiry_ms} * interval '1 millisecond' \
             AND relay <> '{relay}'::uuid"
        )
    }

    /// Shares of a backlog: `relay` stops taking a share. One simple query.
    pub(crate) fn share_leave(&self, relay: Uuid) -> String {
        format!("DELETE FROM {} WHERE relay = '{relay}'::uuid", self.relays)
    }

    /// The statement recording failed events for the chosen ordering.
    pub(crate) fn record_failures(
        &self,
        ordering: bool,
        after_dead_letter: AfterDeadLetter,
    ) -> &str {
        match (ordering, after_dead_letter) {
            (false, _) => &self.record_failures,
            (true, AfterDeadLetter::Release) => &self.record_failures_release,
            (true, AfterDeadLetter::Block) => &self.record_failures_block,
        }
    }
}
