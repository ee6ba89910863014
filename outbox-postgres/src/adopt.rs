//! Adopting an existing outbox table in the seed's layout (`id uuid, aggregate_type,
//! aggregate_id, event_type, payload jsonb, attempts, created_at, processed_at`),
//! in place, while its producers keep writing.
//!
//! The adoption brings the table to exactly the shape migration 1 creates, records
//! migration 1 as applied, and lets [`crate::migrate`] apply the others. What it
//! must not do is rewrite the table under an exclusive lock: a queue table that
//! keeps its processed rows can be large, and every producer would wait. So:
//!
//! 1. **Columns** (one brief exclusive lock, catalog changes only): the missing
//!    columns are added with constant or stable defaults, which PostgreSQL stores
//!    in the catalog instead of writing to every row; `seq` as `bigint NOT NULL
//!    DEFAULT 0` (every existing row reads 0), then its default becomes
//!    `nextval` of a sequence owned by it, starting above any number the backfill
//!    may hand out: the most rows the table's pages can hold, read from its size
//!    under the lock. `varchar` columns become `text` (binary-compatible: no
//!    rewrite). New events get their `seq` from here on.
//! 2. **Backfill** (no table lock, batches of row updates): the pending rows that
//!    existed before step 1 get `seq` 1, 2, ... in `(created_at, id)` order, the
//!    only order the seed's table records; those the previous relay had given up
//!    on (`attempts` at or above its limit) become dead letters. Processed rows
//!    keep `seq` 0: they are never claimed.
//! 3. **Indexes**, built with `CREATE INDEX CONCURRENTLY` (writers go on), and the
//!    seed's claim index dropped the same way.
//! 4. **Finish** (one brief exclusive lock): `seq` becomes the identity column of
//!    migration 1, its sequence continuing where the temporary one stopped;
//!    migration 1 is recorded.
//!
//! Each step looks at the catalog to see whether it is done, so an adoption that
//! was interrupted is resumed by running it again, and adopting twice is a no-op.
//! Every brief lock is taken with a `lock_timeout` and retried: a long transaction
//! on the table makes the adoption wait, not the producers queued behind it.

use std::fmt;
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};

use crate::error::{Error, Result};
use crate::migrate::{migration_1_statements, render, INBOX};
use crate::sql::Sql;
use crate::tables::Tables;

/// How an adoption runs. Build with [`AdoptOptions::default`] and the setters.
#[derive(Debug, Clone)]
pub struct AdoptOptions {
    dead_letter_attempts: Option<i32>,
    batch_size: i64,
    lock_timeout: Duration,
    lock_attempts: u32,
}

impl Default for AdoptOptions {
    fn default() -> Self {
        Self {
            dead_letter_attempts: Some(5),
            batch_size: 10_000,
            lock_timeout: Duration::from_millis(100),
            lock_attempts: 100,
        }
    }
}

impl AdoptOptions {
    /// Pending rows with at least this many `attempts` were given up on by the
    /// previous relay (the seed's relay claims `attempts < max`, its dead-letter
    /// view lists `attempts >= 5`): they become dead letters instead of being
    /// published. `None`: every pending row is published. Defaults to `Some(5)`.
    #[must_use]
    pub fn dead_letter_attempts(mut self, attempts: Option<i32>) -> Self {
        self.dead_letter_attempts = attempts;
        self
    }

    /// Rows numbered per backfill transaction. Defaults to 10,000.
    #[must_use]
    pub fn batch_size(mut self, rows: i64) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// Longest wait for the table's exclusive lock in each try, and how many
    /// tries. Writers that arrive while the request waits queue behind it, so a
    /// try is short; between tries they go on for a while. Defaults to 100 ms and
    /// 100 tries.
    #[must_use]
    pub fn lock_timeout(mut self, wait: Duration, attempts: u32) -> Self {
        self.lock_timeout = wait;
        self.lock_attempts = attempts.max(1);
        self
    }
}

/// What an adoption finds and will do: [`adoption_plan`] (a dry run) or
/// [`adopt`] (what it did). `Display` writes it for an operator.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdoptionPlan {
    /// `schema.table`.
    pub table: String,
    /// The outbox is migrated already (migration 1 recorded): nothing to do.
    pub already_migrated: bool,
    /// Rows not processed (pending, and the previous relay's dead letters).
    pub pending: i64,
    /// Of the pending rows, those that become dead letters.
    pub dead_letters: i64,
    /// Aggregates that have such a dead letter: with `AfterDeadLetter::Block`
    /// (the default), their later events wait until it is retried or purged.
    pub dead_letter_aggregates: i64,
    /// Processed rows: kept, never published again.
    pub processed: i64,
    /// Columns to add.
    pub add_columns: Vec<&'static str>,
    /// Columns whose type changes to `text` (no rewrite).
    pub retype_columns: Vec<String>,
    /// The view of the dead-letter name that is replaced by the outbox's.
    pub replace_view: Option<String>,
    /// The seed's claim index, dropped (it costs producers a write per event).
    pub drop_indexes: Vec<String>,
    /// Indexes built without blocking writers.
    pub build_indexes: Vec<String>,
    /// Left as they are: other indexes, triggers, extra columns.
    pub kept: Vec<String>,
    /// How long [`adopt`] held the table's exclusive lock, writers waiting: the
    /// columns step and the finishing step, each once it had the lock, to its
    /// commit. Empty for a dry run and when there was nothing to adopt.
    pub exclusive_lock_held: Vec<Duration>,
}

impl fmt::Display for AdoptionPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.already_migrated {
            return writeln!(f, "{}: already an outbox of this version's layout (migration 1 recorded): nothing to adopt", self.table);
        }
        writeln!(f, "adopt {}:", self.table)?;
        writeln!(
            f,
            "  rows: {} pending (published in per-aggregate (created_at, id) order), {} processed (kept, not published again)",
            self.pending, self.processed
        )?;
        if self.dead_letters > 0 {
            writeln!(f, "  {} pending rows the previous relay gave up on become dead letters, in {} aggregates (with after_dead_letter = block their later events wait for `outbox dead-letters retry` or `purge`)", self.dead_letters, self.dead_letter_aggregates)?;
        }
        let list = |items: &[String]| items.join(", ");
        if !self.add_columns.is_empty() {
            let columns: Vec<String> = self.add_columns.iter().map(|c| c.to_string()).collect();
            writeln!(
                f,
                "  add columns (catalog only, one brief lock): {}",
                list(&columns)
            )?;
        }
        if !self.retype_columns.is_empty() {
            writeln!(
                f,
                "  change to text (no rewrite): {}",
                list(&self.retype_columns)
            )?;
        }
        if let Some(view) = &self.replace_view {
            writeln!(f, "  replace view {view} by the outbox's dead-letter view (same name, the seed's columns and more)")?;
        }
        if !self.build_indexes.is_empty() {
            writeln!(
                f,
                "  number pending rows in batches, then build indexes concurrently: {}",
                list(&self.build_indexes)
            )?;
        }
        if !self.drop_indexes.is_empty() {
            writeln!(f, "  drop index concurrently: {}", list(&self.drop_indexes))?;
        }
        writeln!(f, "  make seq the identity column (one brief lock), record migration 1, then apply the later migrations")?;
        if !self.kept.is_empty() {
            writeln!(f, "  left as they are: {}", list(&self.kept))?;
        }
        if !self.exclusive_lock_held.is_empty() {
            let held: Vec<String> = self
                .exclusive_lock_held
                .iter()
                .map(|d| format!("{:.1} ms", d.as_secs_f64() * 1000.0))
                .collect();
            writeln!(
                f,
                "  the table was locked (writers waiting) for {}",
                list(&held)
            )?;
        }
        Ok(())
    }
}

/// Columns of migration 1: name, type as `format_type` prints it, NOT NULL.
const SEED_COLUMNS: &[(&str, &str, bool)] = &[
    ("id", "uuid", true),
    ("aggregate_type", "text", true),
    ("aggregate_id", "text", true),
    ("event_type", "text", true),
    ("payload", "jsonb", true),
    ("attempts", "integer", true),
    ("created_at", "timestamp with time zone", true),
    ("processed_at", "timestamp with time zone", false),
];

/// Columns the adoption adds: name, type, NOT NULL, the definition it adds.
const ADDED_COLUMNS: &[(&str, &str, bool, &str)] = &[
    ("seq", "bigint", true, "bigint NOT NULL DEFAULT 0"),
    (
        "headers",
        "jsonb",
        true,
        "jsonb NOT NULL DEFAULT '{}'::jsonb",
    ),
    ("destination", "text", false, "text"),
    (
        "available_at",
        "timestamp with time zone",
        true,
        "timestamptz NOT NULL DEFAULT now()",
    ),
    ("dead_at", "timestamp with time zone", false, "timestamptz"),
    ("last_error", "text", false, "text"),
];

/// One column as the catalog describes it.
#[derive(Debug, sqlx::FromRow)]
struct Column {
    name: String,
    data_type: String,
    not_null: bool,
    default: Option<String>,
    identity: bool,
}

/// What the catalog says about the table.
#[derive(Debug)]
struct Found {
    columns: Vec<Column>,
    primary_key: Option<(String, Vec<String>)>,
    /// Views reading the table: (schema, name).
    views: Vec<(String, String)>,
    /// Indexes: (name, valid, definition).
    indexes: Vec<(String, bool, String)>,
    triggers: Vec<String>,
}

impl Found {
    fn column(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|c| c.name == name)
    }
}

/// The statements of an adoption, for one outbox's names.
struct Statements {
    table: String,
    sql: Sql,
    /// The temporary sequence of step 1, qualified and quoted, and unquoted.
    sequence: String,
    sequence_name: String,
    /// The identity sequence migration 1 would have created.
    identity_sequence: String,
    /// (name, CREATE INDEX CONCURRENTLY statement) of migration 1's event indexes.
    indexes: Vec<(String, String)>,
    view: String,
    inbox: String,
}

impl Statements {
    fn new(tables: &Tables) -> Self {
        let sql = Sql::new(tables);
        let schema = tables.schema().quoted();
        let (indexes, view) = migration_1_statements(&sql.template_names);
        Self {
            table: tables.qualify(tables.events()),
            sequence: format!("{schema}.{}", tables.derived(tables.events(), "adopt_seq")),
            sequence_name: format!("{}_adopt_seq", tables.events()),
            identity_sequence: format!("{schema}.{}", tables.derived(tables.events(), "seq_seq")),
            indexes,
            view,
            inbox: render(INBOX, &sql.template_names),
            sql,
        }
    }
}

/// Look at the outbox table named by `tables` and say what [`adopt`] would do,
/// changing nothing. An error names what keeps the table from being adopted.
pub async fn adoption_plan(
    pool: &PgPool,
    tables: &Tables,
    options: &AdoptOptions,
) -> Result<AdoptionPlan> {
    let mut conn = pool.acquire().await?;
    plan(&mut conn, tables, options).await
}

/// Turn the existing outbox table named by `tables`, in the seed's layout, into
/// this crate's outbox, in place, while its producers keep writing (see the
/// module text), then apply the later migrations ([`crate::migrate`]). Run it
/// after stopping the previous relay; `docs/operations.md` has the handover.
///
/// A table that is neither layout is refused with an error naming the missing or
/// conflicting columns, and nothing is changed. An outbox migrated already (also
/// one adopted before) is left as it is. Needs a direct connection (not through a
/// transaction pooler: indexes are built concurrently, outside a transaction).
pub async fn adopt(pool: &PgPool, tables: &Tables, options: &AdoptOptions) -> Result<AdoptionPlan> {
    let mut conn = pool.acquire().await?;
    let mut plan = plan(&mut conn, tables, options).await?;
    if plan.already_migrated {
        crate::migrate(pool, tables).await?;
        return Ok(plan);
    }
    let s = Statements::new(tables);
    // One adoption at a time per outbox; the session lock goes with the connection.
    let key = format!("{}:adopt", s.sql.migration_lock_key);
    sqlx::query("SELECT pg_advisory_lock(hashtextextended($1, 0))")
        .bind(&key)
        .execute(&mut *conn)
        .await?;
    let result = run(
        &mut conn,
        tables,
        options,
        &s,
        &mut plan.exclusive_lock_held,
    )
    .await;
    let _ = sqlx::query("SELECT pg_advisory_unlock(hashtextextended($1, 0))")
        .bind(&key)
        .execute(&mut *conn)
        .await;
    result?;
    crate::migrate(pool, tables).await?;
    Ok(plan)
}

async fn run(
    conn: &mut PgConnection,
    tables: &Tables,
    options: &AdoptOptions,
    s: &Statements,
    held: &mut Vec<Duration>,
) -> Result<()> {
    // Looked at again under the lock: another adoption may have gone before.
    let plan = plan(conn, tables, options).await?;
    if plan.already_migrated {
        return Ok(());
    }
    let found = inspect(conn, tables).await?;
    if found.column("seq").is_none() {
        held.push(add_columns(conn, tables, options, s, &plan).await?);
        tracing::info!(table = %s.table, "adoption: columns added; new events are numbered");
    }
    let found = inspect(conn, tables).await?;
    let numbering = found
        .column("seq")
        .and_then(|c| c.default.as_deref())
        .is_some_and(|d| d.contains(&s.sequence_name));
    if numbering {
        let numbered = backfill(conn, options, s).await?;
        tracing::info!(table = %s.table, numbered, "adoption: pending rows numbered");
    }
    build_indexes(conn, &found, s).await?;
    for index in &plan.drop_indexes {
        // A name read from the catalog: quoted by the server, not spliced.
        let drop: String =
            sqlx::query_scalar("SELECT format('DROP INDEX CONCURRENTLY IF EXISTS %I.%I', $1, $2)")
                .bind(tables.schema().as_str())
                .bind(index)
                .fetch_one(&mut *conn)
                .await?;
        sqlx::raw_sql(&drop).execute(&mut *conn).await?;
    }
    held.push(finish(conn, tables, options, s, &found, numbering).await?);
    tracing::info!(table = %s.table, "adoption: done, migration 1 recorded");
    Ok(())
}

/// Open a transaction holding the table's exclusive lock, asked for within
/// `lock_timeout`, up to `lock_attempts` times; [`end_locked`] ends it. The
/// transaction is driven with plain `BEGIN`/`COMMIT` on the connection, which is
/// the adoption's own. Returns when the lock was had.
async fn lock(conn: &mut PgConnection, options: &AdoptOptions, s: &Statements) -> Result<Instant> {
    let millis = options.lock_timeout.as_millis().max(1);
    // The lock's wait is bounded, not the work done under it.
    let begin = format!(
        "BEGIN; SET LOCAL lock_timeout = {millis}; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE; \
         SET LOCAL lock_timeout = 0; SELECT pg_advisory_xact_lock(hashtextextended('{}', 0))",
        s.table,
        s.sql.migration_lock_key.replace('\'', "''"),
    );
    let mut attempt = 0;
    loop {
        attempt += 1;
        match sqlx::raw_sql(&begin).execute(&mut *conn).await {
            Ok(_) => return Ok(Instant::now()),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
                sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
                if attempt >= options.lock_attempts {
                    return Err(Error::LockNotFree {
                        table: s.table.clone(),
                        wait: options.lock_timeout,
                        tries: attempt,
                    });
                }
                tracing::warn!(table = %s.table, attempt, "adoption: the table's lock is taken; trying again");
                // Let the writers that queued behind the request through.
                tokio::time::sleep(options.lock_timeout.max(Duration::from_millis(200))).await;
            }
            Err(e) => {
                let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
                return Err(e.into());
            }
        }
    }
}

/// Commit the transaction [`lock`] opened when `work` succeeded, else roll it
/// back; how long the lock was held.
async fn end_locked(
    conn: &mut PgConnection,
    locked_at: Instant,
    work: Result<()>,
) -> Result<Duration> {
    match work {
        Ok(()) => {
            sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
            Ok(locked_at.elapsed())
        }
        Err(e) => {
            let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
            Err(e)
        }
    }
}

/// Step 1: the columns, the numbering of new events, the dead-letter view.
async fn add_columns(
    conn: &mut PgConnection,
    tables: &Tables,
    options: &AdoptOptions,
    s: &Statements,
    plan: &AdoptionPlan,
) -> Result<Duration> {
    let mut changes: Vec<String> = ADDED_COLUMNS
        .iter()
        .filter(|(name, ..)| plan.add_columns.contains(name))
        .map(|(name, _, _, definition)| format!("ADD COLUMN {name} {definition}"))
        .collect();
    changes.extend(
        plan.retype_columns
            .iter()
            .map(|c| format!("ALTER COLUMN {c} TYPE text")),
    );
    let alter = format!("ALTER TABLE {} {}", s.table, changes.join(", "));
    let view = plan
        .replace_view
        .as_ref()
        .map(|_| format!("DROP VIEW {}", tables.qualify(tables.dead_letters())));
    let block_size = "current_setting('block_size')::int8";
    // The most tuples the table's pages can hold (MaxHeapTuplesPerPage: a page
    // header of 24 bytes, 28 per tuple at least), read under the lock: above any
    // number the backfill hands out, however many rows there are.
    let bound = format!(
        "SELECT (pg_relation_size('{table}') / {block_size} + 1) * (({block_size} - 24) / 28) + 1",
        table = s.table.replace('\'', "''"),
    );
    let locked_at = lock(conn, options, s).await?;
    let work = async {
        if let Some(view) = &view {
            sqlx::raw_sql(view).execute(&mut *conn).await?;
        }
        sqlx::raw_sql(&alter).execute(&mut *conn).await?;
        let start: i64 = sqlx::query_scalar(&bound).fetch_one(&mut *conn).await?;
        let numbering = format!(
            "CREATE SEQUENCE {seq} START WITH {start} OWNED BY {table}.seq; \
             ALTER TABLE {table} ALTER COLUMN seq SET DEFAULT nextval('{seq}'::regclass); {view}",
            seq = s.sequence,
            table = s.table,
            view = s.view,
        );
        sqlx::raw_sql(&numbering).execute(&mut *conn).await?;
        Ok(())
    }
    .await;
    end_locked(conn, locked_at, work).await
}

/// Step 2: number the pending rows that existed before step 1, in `(created_at,
/// id)` order, in batches; mark the previous relay's dead letters. Returns how
/// many rows it numbered.
async fn backfill(conn: &mut PgConnection, options: &AdoptOptions, s: &Statements) -> Result<i64> {
    let table = &s.table;
    // Rows numbered by an interrupted run keep their numbers; the rest follow.
    let numbered = format!(
        "SELECT COALESCE(max(seq), 0) FROM {table} \
         WHERE seq > 0 AND seq < (SELECT start_value FROM pg_sequences \
         WHERE schemaname || '.' || sequencename = $1)"
    );
    let sequence = s.sequence.replace('"', "");
    let start: i64 = sqlx::query_scalar(&numbered)
        .bind(&sequence)
        .fetch_one(&mut *conn)
        .await?;
    let order = format!(
        "DROP TABLE IF EXISTS pg_temp.pgoutbox_adopt_order; \
         CREATE TEMP TABLE pgoutbox_adopt_order AS \
         SELECT id, {start} + row_number() OVER (ORDER BY created_at, id) AS n \
         FROM {table} WHERE seq = 0 AND processed_at IS NULL; \
         CREATE INDEX ON pg_temp.pgoutbox_adopt_order (n)"
    );
    sqlx::raw_sql(&order).execute(&mut *conn).await?;
    let last: i64 =
        sqlx::query_scalar("SELECT COALESCE(max(n), 0) FROM pg_temp.pgoutbox_adopt_order")
            .fetch_one(&mut *conn)
            .await?;
    let update = format!(
        "UPDATE {table} e SET seq = o.n, \
         dead_at = CASE WHEN e.attempts >= $3 THEN clock_timestamp() END, \
         last_error = CASE WHEN e.attempts >= $3 THEN 'given up by the previous relay: ' \
         || e.attempts || ' attempts when the outbox was adopted' END \
         FROM pg_temp.pgoutbox_adopt_order o \
         WHERE o.n > $1 AND o.n <= $2 AND e.id = o.id AND e.seq = 0 AND e.processed_at IS NULL"
    );
    let mut from = start;
    while from < last {
        let to = (from + options.batch_size).min(last);
        sqlx::query(&update)
            .bind(from)
            .bind(to)
            .bind(options.dead_letter_attempts.unwrap_or(i32::MAX))
            .execute(&mut *conn)
            .await?;
        from = to;
    }
    sqlx::raw_sql("DROP TABLE pg_temp.pgoutbox_adopt_order")
        .execute(&mut *conn)
        .await?;
    Ok(last - start)
}

/// Step 3: migration 1's indexes, built concurrently; one left invalid by an
/// interrupted build is dropped and built again.
async fn build_indexes(conn: &mut PgConnection, found: &Found, s: &Statements) -> Result<()> {
    for (name, create) in &s.indexes {
        let existing = found.indexes.iter().find(|(n, ..)| n == name);
        if let Some((_, false, _)) = existing {
            let schema = s.table.split('.').next().unwrap_or_default();
            sqlx::raw_sql(&format!("DROP INDEX CONCURRENTLY {schema}.\"{name}\""))
                .execute(&mut *conn)
                .await?;
        }
        sqlx::raw_sql(create).execute(&mut *conn).await?;
    }
    Ok(())
}

/// Step 4: `seq` becomes the identity column, migration 1 is recorded.
async fn finish(
    conn: &mut PgConnection,
    tables: &Tables,
    options: &AdoptOptions,
    s: &Statements,
    found: &Found,
    numbering: bool,
) -> Result<Duration> {
    let pkey = format!("{}_pkey", tables.events());
    // The primary key's name as migration 1 gives it; the old name is read from
    // the catalog: quoted by the server, not spliced.
    let rename: Option<String> = match found.primary_key.as_ref().filter(|(name, _)| *name != pkey)
    {
        Some((name, _)) => Some(
            sqlx::query_scalar(
                "SELECT format('ALTER TABLE %s RENAME CONSTRAINT %I TO %I', $1, $2, $3)",
            )
            .bind(&s.table)
            .bind(name)
            .bind(&pkey)
            .fetch_one(&mut *conn)
            .await?,
        ),
        None => None,
    };
    let identity = !found.column("seq").is_some_and(|c| c.identity);
    let locked_at = lock(conn, options, s).await?;
    let work = async {
        if identity {
            let next: i64 = if numbering {
                sqlx::query_scalar("SELECT nextval($1::regclass)")
                    .bind(&s.sequence)
                    .fetch_one(&mut *conn)
                    .await?
            } else {
                sqlx::query_scalar(&format!(
                    "SELECT COALESCE(max(seq), 0) + 1 FROM {}",
                    s.table
                ))
                .fetch_one(&mut *conn)
                .await?
            };
            let statement = format!(
                "ALTER TABLE {table} ALTER COLUMN seq DROP DEFAULT, \
                 ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY \
                 (SEQUENCE NAME {identity} START WITH {next}); \
                 DROP SEQUENCE IF EXISTS {sequence}",
                table = s.table,
                identity = s.identity_sequence,
                sequence = s.sequence,
            );
            sqlx::raw_sql(&statement).execute(&mut *conn).await?;
        }
        if let Some(rename) = &rename {
            sqlx::raw_sql(rename).execute(&mut *conn).await?;
        }
        sqlx::raw_sql(&s.inbox).execute(&mut *conn).await?;
        sqlx::raw_sql(&s.sql.migrations_table)
            .execute(&mut *conn)
            .await?;
        sqlx::query(&s.sql.record_version)
            .bind(1_i32)
            .bind("outbox")
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
    .await;
    end_locked(conn, locked_at, work).await
}

/// Inspect the table and say what an adoption does; an error for a table that is
/// not the seed's layout (or a partly adopted one).
async fn plan(
    conn: &mut PgConnection,
    tables: &Tables,
    options: &AdoptOptions,
) -> Result<AdoptionPlan> {
    let s = Statements::new(tables);
    let migrations_exist: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&s.sql.migrations_name)
        .fetch_one(&mut *conn)
        .await?;
    let migrated = migrations_exist
        && sqlx::query_scalar::<_, i32>(&s.sql.applied_versions)
            .fetch_all(&mut *conn)
            .await?
            .contains(&1);
    let mut plan = AdoptionPlan {
        table: tables.outbox_name(),
        already_migrated: migrated,
        pending: 0,
        dead_letters: 0,
        dead_letter_aggregates: 0,
        processed: 0,
        add_columns: Vec::new(),
        retype_columns: Vec::new(),
        replace_view: None,
        drop_indexes: Vec::new(),
        build_indexes: Vec::new(),
        kept: Vec::new(),
        exclusive_lock_held: Vec::new(),
    };
    if migrated {
        return Ok(plan);
    }
    let refuse = |mut problems: Vec<String>| {
        problems.push("nothing was changed".into());
        Error::CannotAdopt {
            table: tables.outbox_name(),
            problems,
        }
    };
    let kind: Option<String> =
        sqlx::query_scalar("SELECT c.relkind::text FROM pg_class c WHERE c.oid = to_regclass($1)")
            .bind(&s.table)
            .fetch_optional(&mut *conn)
            .await?;
    match kind.as_deref() {
        Some("r") => {}
        None => {
            return Err(refuse(vec![
                "there is no such table (`outbox migrate` without --adopt creates one)".into(),
            ]))
        }
        Some(other) => {
            return Err(refuse(vec![format!(
                "it is not a plain table (relkind {other})"
            )]))
        }
    }
    let found = inspect(conn, tables).await?;
    let mut missing = Vec::new();
    let mut conflicting = Vec::new();
    for (name, data_type, not_null) in SEED_COLUMNS {
        match found.column(name) {
            None => missing.push(name.to_string()),
            Some(c) => {
                let text_like =
                    *data_type == "text" && c.data_type.starts_with("character varying");
                if c.data_type != *data_type && !text_like {
                    conflicting.push(format!("{name} is {} (needs {data_type})", c.data_type));
                } else if text_like {
                    plan.retype_columns.push(name.to_string());
                }
                if *not_null && !c.not_null {
                    conflicting.push(format!("{name} may be NULL (needs NOT NULL)"));
                }
            }
        }
    }
    for (name, data_type, not_null, _) in ADDED_COLUMNS {
        match found.column(name) {
            None => plan.add_columns.push(name),
            Some(c) if c.data_type != *data_type || c.not_null != *not_null => {
                conflicting.push(format!(
                    "{name} is {}{} (the outbox's is {data_type}{})",
                    c.data_type,
                    if c.not_null { " NOT NULL" } else { "" },
                    if *not_null { " NOT NULL" } else { "" },
                ))
            }
            Some(_) => {}
        }
    }
    let known = |name: &str| {
        SEED_COLUMNS.iter().any(|(n, ..)| *n == name)
            || ADDED_COLUMNS.iter().any(|(n, ..)| *n == name)
    };
    for extra in found.columns.iter().filter(|c| !known(&c.name)) {
        if extra.not_null && extra.default.is_none() {
            conflicting.push(format!(
                "{} is NOT NULL without a default (the outbox's writers do not set it)",
                extra.name
            ));
        } else {
            plan.kept.push(format!("column {}", extra.name));
        }
    }
    match &found.primary_key {
        Some((_, columns)) if columns == &["id"] => {}
        Some((name, columns)) => conflicting.push(format!(
            "the primary key {name} is ({}), not (id)",
            columns.join(", ")
        )),
        None => conflicting.push("id is not the primary key".into()),
    }
    let dead_letters_view = tables.dead_letters().as_str();
    for (schema, view) in &found.views {
        if schema == tables.schema().as_str() && view == dead_letters_view {
            plan.replace_view = Some(format!("{schema}.{view}"));
        } else if !plan.retype_columns.is_empty() {
            conflicting.push(format!(
                "view {schema}.{view} reads the table, whose columns {} change type: drop it before adopting and create it again after",
                plan.retype_columns.join(", ")
            ));
        }
    }
    if !missing.is_empty() {
        let mut problems = vec![format!("missing column(s): {}", missing.join(", "))];
        problems.extend(conflicting);
        return Err(refuse(problems));
    }
    if !conflicting.is_empty() {
        return Err(refuse(conflicting));
    }
    if found.column("seq").is_some() && plan.replace_view.is_some() {
        // After step 1 the view of that name is the outbox's own.
        plan.replace_view = None;
    }
    for (name, _) in &s.indexes {
        let valid = found
            .indexes
            .iter()
            .any(|(n, valid, _)| n == name && *valid);
        if !valid {
            plan.build_indexes.push(name.clone());
        }
    }
    for (name, _, definition) in &found.indexes {
        let ours = s.indexes.iter().any(|(n, _)| n == name)
            || *name == format!("{}_pkey", tables.events());
        let seed_claim_index =
            definition.ends_with("USING btree (created_at) WHERE (processed_at IS NULL)");
        if seed_claim_index {
            plan.drop_indexes.push(name.clone());
        } else if !ours && found.primary_key.as_ref().is_none_or(|(pk, _)| pk != name) {
            plan.kept.push(format!("index {name}"));
        }
    }
    plan.kept
        .extend(found.triggers.iter().map(|t| format!("trigger {t}")));
    let dead_at = if found.column("dead_at").is_some() {
        "dead_at IS NULL"
    } else {
        "true"
    };
    let limit = options.dead_letter_attempts.unwrap_or(i32::MAX);
    let counts: (i64, i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*) FILTER (WHERE processed_at IS NULL), \
         count(*) FILTER (WHERE processed_at IS NULL AND {dead_at} AND attempts >= $1), \
         count(DISTINCT (aggregate_type, aggregate_id)) FILTER (WHERE processed_at IS NULL AND {dead_at} AND attempts >= $1), \
         count(*) FILTER (WHERE processed_at IS NOT NULL) FROM {}",
        s.table
    ))
    .bind(limit)
    .fetch_one(&mut *conn)
    .await?;
    (
        plan.pending,
        plan.dead_letters,
        plan.dead_letter_aggregates,
        plan.processed,
    ) = counts;
    Ok(plan)
}

/// Read the table's columns, primary key, views, indexes and triggers.
async fn inspect(conn: &mut PgConnection, tables: &Tables) -> Result<Found> {
    let table = tables.qualify(tables.events());
    let columns: Vec<Column> = sqlx::query_as(
        "SELECT a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS data_type, \
         a.attnotnull AS not_null, pg_get_expr(d.adbin, d.adrelid) AS default, \
         a.attidentity <> '' AS identity \
         FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
         WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
    )
    .bind(&table)
    .fetch_all(&mut *conn)
    .await?;
    let primary_key: Option<(String, Vec<String>)> = sqlx::query_as(
        "SELECT c.conname::text, ARRAY(SELECT a.attname::text FROM unnest(c.conkey) k \
         JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k) \
         FROM pg_constraint c WHERE c.conrelid = to_regclass($1) AND c.contype = 'p'",
    )
    .bind(&table)
    .fetch_optional(&mut *conn)
    .await?;
    let views: Vec<(String, String)> = sqlx::query_as(
        "SELECT DISTINCT n.nspname::text, v.relname::text FROM pg_depend d \
         JOIN pg_rewrite r ON r.oid = d.objid JOIN pg_class v ON v.oid = r.ev_class \
         JOIN pg_namespace n ON n.oid = v.relnamespace \
         WHERE d.classid = 'pg_rewrite'::regclass AND d.refobjid = to_regclass($1) \
         AND v.oid <> d.refobjid ORDER BY 1, 2",
    )
    .bind(&table)
    .fetch_all(&mut *conn)
    .await?;
    let indexes: Vec<(String, bool, String)> = sqlx::query_as(
        "SELECT c.relname::text, i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i \
         JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass($1) ORDER BY 1",
    )
    .bind(&table)
    .fetch_all(&mut *conn)
    .await?;
    let triggers: Vec<String> = sqlx::query_scalar(
        "SELECT tgname::text FROM pg_trigger WHERE tgrelid = to_regclass($1) AND NOT tgisinternal ORDER BY 1",
    )
    .bind(&table)
    .fetch_all(&mut *conn)
    .await?;
    Ok(Found {
        columns,
        primary_key,
        views,
        indexes,
        triggers,
    })
}
