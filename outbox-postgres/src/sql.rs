//! Every SQL statement of this crate, rendered once per [`Tables`] from validated names.

use crate::tables::Tables;

/// Columns read into an `outbox_core::Event`, in the order `row::event` decodes them.
const EVENT_COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, \
    payload::text AS payload, headers::text AS headers, destination, attempts, created_at";

/// What to do with the followers of a dead-lettered event when ordering is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AfterDeadLetter {
    /// The next event of the aggregate becomes publishable: one poison event does not
    /// stall its aggregate, at the price of a gap (and, if the dead letter is retried
    /// later, of that event arriving after its followers). The default.
    #[default]
    Release,
    /// The aggregate stays blocked until an operator retries or purges the dead letter:
    /// order is never broken, but the aggregate's later events wait.
    Block,
}

/// The statements, with quoted names in place.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) create_schema: String,
    pub(crate) migrations_table: String,
    pub(crate) applied_versions: String,
    pub(crate) record_version: String,
    pub(crate) migration_lock_key: String,
    pub(crate) template_names: Vec<(&'static str, String)>,

    pub(crate) enqueue_one: String,
    pub(crate) enqueue_many: String,

    pub(crate) claim_unordered: String,
    pub(crate) claim_ordered_release: String,
    pub(crate) claim_ordered_block: String,
    pub(crate) delete_published: String,
    pub(crate) mark_published: String,
    pub(crate) record_failures: String,
    pub(crate) count_pending: String,
    pub(crate) probe_due: String,
    pub(crate) stats: String,
    pub(crate) count_due: String,
    pub(crate) count_due_unlocked: String,

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
        let claim = |ordering: &str| {
            format!(
                "SELECT {EVENT_COLUMNS} FROM {events} e \
                 WHERE e.processed_at IS NULL AND e.dead_at IS NULL AND e.available_at <= now() \
                 {ordering} \
                 ORDER BY e.seq LIMIT $1 FOR UPDATE SKIP LOCKED"
            )
        };
        // Only the oldest unpublished event of an aggregate is claimable; a claimed
        // (locked), backing-off or failing head hides its followers from every relay.
        // Written as a correlated `seq = (... ORDER BY <aggregate index> LIMIT 1)` so the
        // plan is an index probe per candidate whatever the table statistics say (a
        // NOT EXISTS was planned as a quadratic join on a freshly filled table).
        let head = |dead: &str| {
            format!(
                "AND e.seq = (SELECT p.seq FROM {events} p \
                 WHERE p.aggregate_type = e.aggregate_type AND p.aggregate_id = e.aggregate_id \
                 AND p.processed_at IS NULL {dead} \
                 ORDER BY p.aggregate_type, p.aggregate_id, p.seq LIMIT 1)"
            )
        };
        // Filters shared by the dead-letter statements; NULL parameters match everything.
        let dead = "dead_at IS NOT NULL AND processed_at IS NULL \
             AND ($1::text IS NULL OR event_type = $1) \
             AND ($2::text IS NULL OR aggregate_type = $2) \
             AND ($3::text IS NULL OR aggregate_id = $3) \
             AND ($4::float8 IS NULL OR dead_at < now() - $4 * interval '1 second') \
             AND ($5::uuid[] IS NULL OR id = ANY($5))";
        Self {
            create_schema: format!("CREATE SCHEMA IF NOT EXISTS {}", tables.schema().quoted()),
            migrations_table: format!(
                "CREATE TABLE IF NOT EXISTS {migrations} (version integer PRIMARY KEY, \
                 name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            ),
            applied_versions: format!("SELECT version FROM {migrations}"),
            record_version: format!("INSERT INTO {migrations} (version, name) VALUES ($1, $2)"),
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
                ("notify_channel", format!("'{notify_channel}'")),
            ],

            enqueue_one: format!(
                "INSERT INTO {events} (id, aggregate_type, aggregate_id, event_type, payload, \
                 headers, destination, available_at) \
                 VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, COALESCE($8, now()))"
            ),
            enqueue_many: format!(
                "INSERT INTO {events} (id, aggregate_type, aggregate_id, event_type, payload, \
                 headers, destination, available_at) \
                 SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::jsonb, \
                 u.headers::jsonb, u.destination, COALESCE(u.available_at, now()) \
                 FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], \
                 $6::text[], $7::text[], $8::timestamptz[]) WITH ORDINALITY \
                 AS u(id, aggregate_type, aggregate_id, event_type, payload, headers, \
                 destination, available_at, n) ORDER BY u.n"
            ),

            claim_unordered: claim(""),
            claim_ordered_release: claim(&head("AND p.dead_at IS NULL")),
            claim_ordered_block: claim(&head("")),
            delete_published: format!("DELETE FROM {events} WHERE id = ANY($1)"),
            mark_published: format!(
                "UPDATE {events} SET processed_at = clock_timestamp(), attempts = attempts + 1 \
                 WHERE id = ANY($1)"
            ),
            record_failures: format!(
                "UPDATE {events} e SET attempts = e.attempts + 1, last_error = f.error, \
                 available_at = clock_timestamp() + f.delay_ms * interval '1 millisecond', \
                 dead_at = CASE WHEN f.dead THEN clock_timestamp() END \
                 FROM unnest($1::uuid[], $2::text[], $3::float8[], $4::bool[]) \
                 AS f(id, error, delay_ms, dead) WHERE e.id = f.id"
            ),
            count_pending: format!("SELECT count(*) FROM {events} WHERE {pending}"),
            probe_due: format!(
                "SELECT EXISTS (SELECT 1 FROM {events} WHERE {pending} AND available_at <= now())"
            ),
            stats: format!(
                "SELECT count(*) FILTER (WHERE {pending}), \
                 count(*) FILTER (WHERE {pending} AND available_at > now()), \
                 count(*) FILTER (WHERE dead_at IS NOT NULL AND processed_at IS NULL), \
                 COALESCE(extract(epoch FROM now() - min(created_at) FILTER (WHERE {pending})), 0)::float8, \
                 count(*) FILTER (WHERE processed_at > now() - interval '1 hour') \
                 FROM {events}"
            ),

            count_due: format!(
                "SELECT count(*) FROM (SELECT 1 FROM {events} \
                 WHERE {pending} AND available_at <= now() LIMIT $1) d"
            ),
            // FOR KEY SHARE conflicts with the relays' FOR UPDATE: locked rows are skipped.
            count_due_unlocked: format!(
                "SELECT count(*) FROM (SELECT 1 FROM {events} \
                 WHERE {pending} AND available_at <= now() LIMIT $1 FOR KEY SHARE SKIP LOCKED) f"
            ),
            dead_count: format!("SELECT count(*) FROM {events} WHERE {dead}"),
            dead_list: format!(
                "SELECT {EVENT_COLUMNS}, last_error, dead_at FROM {events} WHERE {dead} \
                 ORDER BY seq LIMIT $6"
            ),
            dead_retry: format!(
                "UPDATE {events} SET dead_at = NULL, attempts = 0, available_at = now() \
                 WHERE {dead}"
            ),
            dead_purge: format!("DELETE FROM {events} WHERE {dead}"),

            cleanup_processed: format!(
                "DELETE FROM {events} WHERE id IN (SELECT id FROM {events} \
                 WHERE processed_at < now() - $1 * interval '1 second' \
                 ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
            ),
            cleanup_inbox: format!(
                "DELETE FROM {inbox} WHERE (consumer, event_id) IN (SELECT consumer, event_id \
                 FROM {inbox} WHERE processed_at < now() - $1 * interval '1 second' LIMIT $2 \
                 FOR UPDATE SKIP LOCKED)"
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
        }
    }

    /// The claim statement for the chosen ordering.
    pub(crate) fn claim(&self, ordering: bool, after_dead_letter: AfterDeadLetter) -> &str {
        match (ordering, after_dead_letter) {
            (false, _) => &self.claim_unordered,
            (true, AfterDeadLetter::Release) => &self.claim_ordered_release,
            (true, AfterDeadLetter::Block) => &self.claim_ordered_block,
        }
    }
}
