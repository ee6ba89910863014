//! The administration commands: `migrate`, `dead-letters`, `stats`, `cleanup`.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use pgoutbox_core::{DeadLetter, DeadLetterAdmin, DeadLetterFilter, Publisher, StatsAdmin};
use pgoutbox_postgres::{Cleanup, DeadLetters, Ident, PgStore, Retention, Tables, Wakeup};
use serde_json::json;
use uuid::Uuid;

use crate::broker::{Prepare, Spec};
use crate::config::{Settings, WalSettings};
use crate::db;
use crate::dead_letters::{self, Change};
use crate::failure::{self, Failure};
use crate::targets::{self, Pools, Target};
use crate::wal_slot;

/// Dead letters shown by a dry run or before a confirmation.
const PREVIEW: u32 = 20;
/// Most due events probed for locks by `stats` (the probe locks each row briefly).
const IN_FLIGHT_PROBE_LIMIT: u32 = 10_000;

/// The outboxes of an admin command (all, or the one `--outbox` names), each
/// checked to be migrated, with the pools they are on.
async fn migrated_targets(
    settings: &Settings,
    selector: Option<&str>,
) -> Result<(Pools, Vec<Target>), Failure> {
    let mut pools = Pools::default();
    let targets = targets::resolve(settings, &mut pools, selector).await?;
    for target in &targets {
        db::ensure_migrated(&target.pool, &target.tables).await?;
    }
    Ok((pools, targets))
}

/// Before each outbox's part of a command's output, when it acts on several.
fn heading(targets: &[Target], target: &Target) {
    if targets.len() > 1 {
        println!("== outbox {} ==", target.name);
    }
}

/// Options of `outbox migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct MigrateArgs {
    /// Print the SQL instead of applying it (no database connection), for a migration
    /// tool of your own: schema, migrations table, each migration with its version
    /// record, for the configured names. Apply it in one transaction.
    #[arg(long)]
    print_sql: bool,
    /// With --print-sql: only the migrations after this version (an upgrade script).
    #[arg(
        long,
        value_name = "VERSION",
        requires = "print_sql",
        default_value_t = 0
    )]
    after: i32,
    /// Only the consumer inbox table (a service that consumes events and writes
    /// none): applied, or printed with --print-sql.
    #[arg(long, conflicts_with = "after")]
    inbox_only: bool,
    /// Adopt an existing outbox table in the seed's layout (`id, aggregate_type,
    /// aggregate_id, event_type, payload, attempts, created_at, processed_at`) in
    /// place, while its producers write: its pending events are then published, in
    /// per-aggregate (created_at, id) order. Stop the old relay first
    /// (docs/operations.md, "Adopting an existing outbox").
    #[arg(long, conflicts_with_all = ["print_sql", "inbox_only"])]
    adopt: bool,
    /// With --adopt: say what the adoption would do and change nothing.
    #[arg(long, requires = "adopt")]
    dry_run: bool,
    /// With --adopt: pending rows with at least this many attempts were given up on
    /// by the old relay and become dead letters; 0 publishes them all.
    #[arg(long, requires = "adopt", value_name = "N", default_value_t = 5)]
    dead_letter_attempts: i32,
}

/// `outbox migrate`: every configured outbox (and the `[tenants]` schemas that
/// exist, to bring them up to date), or the one `--outbox` names.
pub(crate) async fn migrate(
    settings: &Settings,
    args: &MigrateArgs,
    selector: Option<&str>,
) -> Result<(), Failure> {
    if args.print_sql {
        return print_sql(settings, args, selector);
    }
    let mut pools = Pools::default();
    let targets = targets::resolve(settings, &mut pools, selector).await?;
    for target in &targets {
        let (pool, t) = (&target.pool, &target.tables);
        if args.inbox_only {
            pgoutbox_postgres::migrate_inbox(pool, t)
                .await
                .map_err(failure::db("migrate --inbox-only"))?;
            println!("inbox is up to date: {}.{}", t.schema(), t.inbox());
            continue;
        }
        // WAL mode: the slot is checked before anything changes; one of that name
        // that cannot carry this database's events is refused.
        let wal = match &settings.wal {
            Some(wal) => Some((wal, wal_preflight(pool, t, wal).await?)),
            None => None,
        };
        if args.adopt {
            let options = pgoutbox_postgres::AdoptOptions::default().dead_letter_attempts(
                (args.dead_letter_attempts > 0).then_some(args.dead_letter_attempts),
            );
            if args.dry_run {
                let plan = pgoutbox_postgres::adoption_plan(pool, t, &options)
                    .await
                    .map_err(adoption_failure)?;
                print!("{plan}");
                println!("dry run: nothing was changed");
                continue;
            }
            let plan = pgoutbox_postgres::adopt(pool, t, &options)
                .await
                .map_err(adoption_failure)?;
            print!("{plan}");
            if !plan.already_migrated {
                println!("adopted: {} is an outbox of this version", plan.table);
            }
        } else {
            pgoutbox_postgres::migrate(pool, t)
                .await
                .map_err(failure::db("migrate"))?;
        }
        if matches!(settings.wakeup, Wakeup::Notify { .. }) {
            pgoutbox_postgres::install_notify_trigger(pool, t)
                .await
                .map_err(failure::db("installing the notify trigger"))?;
            println!("relay.wakeup = \"notify\": notify trigger installed (it costs producers throughput; see docs/operations.md)");
        }
        println!(
            "outbox schema is up to date: {}.{} (dead letters view {}, inbox {})",
            t.schema(),
            t.events(),
            t.dead_letters(),
            t.inbox()
        );
        if let Some((wal, slot)) = wal {
            let created = pgoutbox_postgres::wal::slot::create(pool, &slot, &wal.publication)
                .await
                .map_err(failure::db("creating the WAL outbox's slot"))?;
            // Producers writing from SQL (`<events>_emit`) are checked against it too.
            pgoutbox_postgres::wal::slot::guard_emit_function(pool, t, &slot)
                .await
                .map_err(failure::db("guarding the SQL emit function"))?;
            println!(
                "WAL outbox: replication slot {slot} {}{} (publication {})",
                if created { "created" } else { "exists" },
                wal_slot::former_note(t, &slot),
                wal.publication
            );
        }
    }
    pools.close().await;
    Ok(())
}

/// Before `migrate` changes anything in WAL mode: `wal_level` is `logical`, and
/// the outbox's slot ([`wal_slot::resolve`]) is missing or can carry this
/// database's events. The slot.
async fn wal_preflight(
    pool: &sqlx::PgPool,
    tables: &Tables,
    wal: &WalSettings,
) -> Result<Ident, Failure> {
    pgoutbox_postgres::wal::slot::check_wal_level(pool)
        .await
        .map_err(|e| Failure::config(e.to_string()))?;
    let slot = wal_slot::resolve(pool, tables, wal).await?;
    if pgoutbox_postgres::wal::slot::exists(pool, &slot)
        .await
        .map_err(failure::db("migrate: the WAL slot"))?
    {
        wal_slot::check(pool, &slot).await?;
    }
    Ok(slot)
}

/// A table that cannot be adopted is a usage mistake (exit 2): the operator named
/// the wrong table or must change it first. Anything else failed at run time.
fn adoption_failure(error: pgoutbox_postgres::Error) -> Failure {
    match error {
        error @ pgoutbox_postgres::Error::CannotAdopt { .. } => {
            Failure::config(format!("migrate --adopt: {error}"))
        }
        error => failure::db("migrate --adopt")(error),
    }
}

/// `outbox migrate --print-sql`: the script of each configured outbox, without a
/// connection (so not the `[tenants]` schemas, which are found in the database).
fn print_sql(
    settings: &Settings,
    args: &MigrateArgs,
    selector: Option<&str>,
) -> Result<(), Failure> {
    let named: Vec<(String, &Tables)> = if settings.grouped() {
        settings
            .outboxes
            .iter()
            .map(|o| (o.name.clone(), &o.tables))
            .collect()
    } else {
        vec![(settings.tables.outbox_name(), &settings.tables)]
    };
    let chosen: Vec<&(String, &Tables)> = named
        .iter()
        .filter(|(name, t)| {
            selector.is_none_or(|s| s == name || s == t.outbox_name() || s == t.schema().as_str())
        })
        .collect();
    if chosen.is_empty() {
        return Err(Failure::config(format!(
            "--outbox {}: no configured outbox of that name (the [tenants] schemas are not listed without a connection)",
            selector.unwrap_or_default()
        )));
    }
    for (name, t) in chosen {
        if named.len() > 1 {
            println!("-- outbox {name}");
        }
        let script = if args.inbox_only {
            pgoutbox_postgres::inbox_script(t)
        } else {
            pgoutbox_postgres::migration_script(t, args.after)
        };
        print!("{script}");
    }
    Ok(())
}

/// `outbox check`: the configuration (already read), the database, the broker.
pub(crate) async fn check(
    settings: &Settings,
    broker: Spec,
    selector: Option<&str>,
) -> Result<(), Failure> {
    println!("config    ok");
    let (pools, targets) = migrated_targets(settings, selector).await?;
    for target in &targets {
        println!("database  ok: reachable, outbox {} migrated", target.name);
    }
    if let (Some(wal), Some(target)) = (&settings.wal, targets.first()) {
        let pool = &target.pool;
        pgoutbox_postgres::wal::slot::check_wal_level(pool)
            .await
            .map_err(|e| Failure::config(e.to_string()))?;
        let slot = wal_slot::resolve(pool, &target.tables, wal).await?;
        wal_slot::check(pool, &slot).await?;
        println!(
            "wal       ok: wal_level = logical, slot {slot}{} can carry this database's events",
            wal_slot::former_note(&target.tables, &slot)
        );
    }
    pools.close().await;
    let name = broker.name().to_string();
    let publisher = broker.build(Prepare::No).await?;
    let limit = settings.http.check_timeout;
    match tokio::time::timeout(limit, Publisher::check(&publisher)).await {
        Ok(Ok(())) => {
            println!("broker    ok: {name} reachable");
            Ok(())
        }
        Ok(Err(error)) => Err(Failure::runtime(format!(
            "broker {name}: not reachable: {error}"
        ))),
        Err(_) => Err(Failure::runtime(format!(
            "broker {name}: no answer within {}",
            humantime::format_duration(limit)
        ))),
    }
}

/// `outbox stats`.
pub(crate) async fn stats(
    settings: &Settings,
    as_json: bool,
    selector: Option<&str>,
) -> Result<(), Failure> {
    let (pools, targets) = migrated_targets(settings, selector).await?;
    for target in &targets {
        if !as_json {
            heading(&targets, target);
        }
        stats_of(settings, target, as_json).await?;
    }
    pools.close().await;
    Ok(())
}

/// One outbox's `stats`.
async fn stats_of(settings: &Settings, target: &Target, as_json: bool) -> Result<(), Failure> {
    let pool = &target.pool;
    let store = PgStore::new(pool.clone(), target.tables.clone());
    let stats = StatsAdmin::stats(&store)
        .await
        .map_err(failure::store("stats"))?;
    let in_flight = store
        .in_flight(IN_FLIGHT_PROBE_LIMIT)
        .await
        .map_err(failure::db("stats: in-flight probe"))?;
    let age = Duration::from_secs(stats.oldest_pending_age.as_secs());
    let horizon = store
        .horizon()
        .await
        .map_err(failure::db("stats: xmin horizon"))?;
    // WAL mode: how much WAL the slot's reader has not acknowledged yet.
    let slot_lag = match &settings.wal {
        Some(wal) => {
            let slot = wal_slot::resolve(pool, &target.tables, wal).await?;
            wal_slot::check(pool, &slot).await?;
            pgoutbox_postgres::wal::slot::lag_bytes(pool, &slot)
                .await
                .map_err(failure::db("stats: slot lag"))?
                .map(|bytes| (slot.as_str().to_string(), bytes))
        }
        None => None,
    };
    if as_json {
        let mut line = json!({
            "outbox": target.name,
            "pending": stats.pending,
            "scheduled": stats.scheduled,
            "in_flight": in_flight,
            "dead_letters": stats.dead_letters,
            "oldest_pending_age_seconds": stats.oldest_pending_age.as_secs_f64(),
            "processed_last_hour": stats.processed_last_hour,
            "held_aggregates": stats.held_aggregates,
            "oldest_snapshot_age_seconds": horizon.oldest_snapshot_age.map(|a| a.as_secs_f64()),
            "oldest_snapshot_holder": horizon.oldest_snapshot_holder,
            "xmin_age_transactions": horizon.xmin_age,
            "producer_transaction_age_seconds": horizon.oldest_producer_age.map(|a| a.as_secs_f64()),
        });
        if let Some((slot, bytes)) = &slot_lag {
            line["wal_slot"] = json!(slot);
            line["wal_slot_lag_bytes"] = json!(bytes);
        }
        println!("{line}");
    } else {
        let kept = match settings.store.retention {
            Retention::Keep(_) => "",
            Retention::Delete => " (counted only when published rows are kept)",
        };
        println!("pending              {}", stats.pending);
        println!("  scheduled (later)  {}", stats.scheduled);
        match in_flight {
            Some(n) => println!("  in flight (locked) {n}"),
            None => println!("  in flight (locked) n/a (more than {IN_FLIGHT_PROBE_LIMIT} due)"),
        }
        println!("  held aggregates    {}", stats.held_aggregates);
        println!("dead letters         {}", stats.dead_letters);
        println!("oldest pending age   {}", humantime::format_duration(age));
        println!("published last hour  {}{kept}", stats.processed_last_hour);
        let whole = |age: Duration| humantime::format_duration(Duration::from_secs(age.as_secs()));
        match (horizon.oldest_snapshot_age, &horizon.oldest_snapshot_holder) {
            (Some(age), Some(holder)) => {
                println!("oldest snapshot      {} ({holder})", whole(age));
            }
            (None, Some(holder)) => println!("oldest snapshot      {holder}"),
            _ => println!("oldest snapshot      none"),
        }
        if let Some(xids) = horizon.xmin_age {
            println!("  xmin horizon       {xids} transactions old (vacuum keeps what is newer)");
        }
        match horizon.oldest_producer_age {
            Some(age) => println!(
                "open producer        {} (claims wait for its event)",
                whole(age)
            ),
            None => println!("open producer        none"),
        }
        if let Some((slot, bytes)) = &slot_lag {
            println!("WAL slot {slot} lag  {bytes} bytes not yet acknowledged");
        }
    }
    Ok(())
}

/// `outbox cleanup`: one retention pass over each outbox.
pub(crate) async fn cleanup(settings: &Settings, selector: Option<&str>) -> Result<(), Failure> {
    let (pools, targets) = migrated_targets(settings, selector).await?;
    for target in &targets {
        heading(&targets, target);
        let store = PgStore::new(target.pool.clone(), target.tables.clone());
        let cleanup = Cleanup::new(target.pool.clone(), store.outbox())
            .with_batch_size(settings.retention.cleanup_batch_size);
        let (events, inbox) = crate::serve::clean_once(&cleanup, &target.name, &settings.retention)
            .await
            .map_err(failure::store("cleanup"))?;
        match settings.retention.published {
            Retention::Keep(age) => println!(
                "deleted {events} published event(s) older than {}",
                humantime::format_duration(age)
            ),
            Retention::Delete => println!(
                "retention.published = \"delete\": published events are deleted when published; none to clean"
            ),
        }
        match settings.retention.inbox {
            Some(age) => println!(
                "deleted {inbox} inbox record(s) older than {}",
                humantime::format_duration(age)
            ),
            None => println!("retention.inbox not set: inbox records kept"),
        }
    }
    pools.close().await;
    Ok(())
}

/// Which dead letters, from the command line.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct FilterArgs {
    /// Only this event type.
    #[arg(long)]
    event_type: Option<String>,
    /// Only this aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only this aggregate id.
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Only dead letters older than this (dead-lettered that long ago): 10m, 2h, 7d.
    #[arg(long, value_parser = crate::config::parse_duration)]
    older_than: Option<Duration>,
    /// Only dead letters whose last error contains this text (case-insensitive).
    #[arg(long = "error", value_name = "TEXT")]
    error_contains: Option<String>,
    /// Only this event id; repeat for several.
    #[arg(long = "id", value_name = "EVENT_ID")]
    ids: Vec<Uuid>,
}

impl FilterArgs {
    fn filter(&self) -> DeadLetterFilter {
        let mut filter = DeadLetterFilter::default();
        filter.event_type = self.event_type.clone();
        filter.aggregate_type = self.aggregate_type.clone();
        filter.aggregate_id = self.aggregate_id.clone();
        filter.older_than = self.older_than;
        filter.error_contains = self.error_contains.clone();
        filter.ids = (!self.ids.is_empty()).then(|| self.ids.clone());
        filter
    }
}

/// Options of the `dead-letters` subcommands that change them (`retry`, `purge`).
#[derive(Debug, clap::Args)]
pub(crate) struct ChangeArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Print what would change; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short)]
    yes: bool,
}

/// `outbox dead-letters ...`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum DeadLettersCommand {
    /// List dead letters, oldest first.
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Show at most this many per outbox (each outbox's list says how many it
        /// has in all).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter with its payload, headers and last error.
    Show {
        /// The event id.
        id: Uuid,
        /// As one JSON object (with the whole payload).
        #[arg(long)]
        json: bool,
        /// The whole payload, however large (by default at most 4 KiB of it).
        #[arg(long)]
        full: bool,
    },
    // Each says in the help of --dry-run what it would change.
    /// Make dead letters publishable again (attempts reset, due now).
    #[command(mut_arg("dry_run", |a| a.help("Print what would be retried; change nothing")))]
    Retry(ChangeArgs),
    /// Delete dead letters for good.
    #[command(mut_arg("dry_run", |a| a.help("Print what would be deleted; change nothing")))]
    Purge(ChangeArgs),
}

/// Run a `dead-letters` subcommand on each outbox (`show`: the one holding the id).
pub(crate) async fn dead_letters(
    settings: &Settings,
    command: &DeadLettersCommand,
    selector: Option<&str>,
) -> Result<(), Failure> {
    let (pools, targets) = migrated_targets(settings, selector).await?;
    let admin_of = |target: &Target| {
        let store = PgStore::new(target.pool.clone(), target.tables.clone());
        DeadLetters::new(target.pool.clone(), store.outbox())
    };
    let result = async {
        match command {
            DeadLettersCommand::Show { id, json, full } => {
                for target in &targets {
                    if show(&admin_of(target), &target.name, *id, *json, *full).await? {
                        return Ok(());
                    }
                }
                Err(Failure::runtime(format!("no dead letter with id {id}")))
            }
            DeadLettersCommand::List {
                filter,
                limit,
                json,
            } => {
                for target in &targets {
                    if !json {
                        heading(&targets, target);
                    }
                    list(
                        &admin_of(target),
                        &target.name,
                        &filter.filter(),
                        *limit,
                        *json,
                    )
                    .await?;
                }
                Ok(())
            }
            DeadLettersCommand::Retry(args) | DeadLettersCommand::Purge(args) => {
                let kind = match command {
                    DeadLettersCommand::Retry(_) => Change::Retry,
                    _ => Change::Purge,
                };
                for target in &targets {
                    heading(&targets, target);
                    change(&admin_of(target), &target.name, kind, args).await?;
                }
                Ok(())
            }
        }
    }
    .await;
    pools.close().await;
    result
}

async fn list(
    admin: &impl DeadLetterAdmin,
    outbox: &str,
    filter: &DeadLetterFilter,
    limit: u32,
    as_json: bool,
) -> Result<(), Failure> {
    let total = admin
        .count(filter)
        .await
        .map_err(failure::store("dead letters"))?;
    let letters = admin
        .list(filter, limit)
        .await
        .map_err(failure::store("dead letters"))?;
    if as_json {
        for letter in &letters {
            println!("{}", to_json(outbox, letter));
        }
        return Ok(());
    }
    print_table(&letters);
    if total > letters.len() as u64 {
        println!(
            "({} of {total} shown; use --limit or filters)",
            letters.len()
        );
    } else {
        println!("({total} dead letter(s))");
    }
    Ok(())
}

/// Most payload bytes `dead-letters show` prints without `--full`: a dead letter
/// may be one because it is megabytes large.
const SHOWN_PAYLOAD: usize = 4096;

/// `payload`, cut to at most `limit` bytes (at a character boundary) with a note
/// saying how large it is.
fn shown_payload(payload: &str, limit: usize) -> String {
    if payload.len() <= limit {
        return payload.to_string();
    }
    let mut end = limit;
    while !payload.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}... ({} bytes in all; --full or --json for the whole payload)",
        &payload[..end],
        payload.len()
    )
}

/// Show dead letter `id` if this outbox holds it; whether it did.
async fn show(
    admin: &impl DeadLetterAdmin,
    outbox: &str,
    id: Uuid,
    as_json: bool,
    full: bool,
) -> Result<bool, Failure> {
    let Some(letter) = admin
        .show(id)
        .await
        .map_err(failure::store("dead letters"))?
    else {
        return Ok(false);
    };
    if as_json {
        println!("{}", to_json(outbox, &letter));
        return Ok(true);
    }
    let e = &letter.event;
    println!("outbox          {outbox}");
    println!("id              {}", e.id);
    println!("event type      {}", e.event_type);
    println!("aggregate       {} {}", e.aggregate_type, e.aggregate_id);
    println!("created at      {}", e.created_at.to_rfc3339());
    println!("dead at         {}", letter.dead_at.to_rfc3339());
    println!("attempts        {}", e.attempts);
    if let Some(destination) = &e.destination {
        println!("destination     {destination}");
    }
    println!(
        "last error      {}",
        letter.last_error.as_deref().unwrap_or("-")
    );
    println!(
        "headers         {}",
        serde_json::to_string(&e.headers).unwrap_or_default()
    );
    let limit = if full { usize::MAX } else { SHOWN_PAYLOAD };
    println!("payload         {}", shown_payload(e.payload.get(), limit));
    Ok(true)
}

async fn change(
    admin: &impl DeadLetterAdmin,
    outbox: &str,
    change: Change,
    args: &ChangeArgs,
) -> Result<(), Failure> {
    let verb = change.verb();
    let done = match change {
        Change::Retry => "retried (publishable again)",
        Change::Purge => "purged (deleted)",
    };
    let filter = &args.filter.filter();
    let n = admin
        .count(filter)
        .await
        .map_err(failure::store("dead letters"))?;
    if n == 0 {
        println!("no dead letters match; nothing to {verb}");
        return Ok(());
    }
    let preview = admin
        .list(filter, PREVIEW)
        .await
        .map_err(failure::store("dead letters"))?;
    if args.dry_run || !args.yes {
        // What would change: the first dead letters, and how many more.
        print_table(&preview);
        if n > preview.len() as u64 {
            println!("... and {} more", n - preview.len() as u64);
        }
    }
    if args.dry_run {
        println!("dry run: would {verb} {n} dead letter(s); nothing changed");
        return Ok(());
    }
    if !args.yes {
        confirm(&format!("{verb} {n} dead letter(s)?"))?;
    }
    let affected = dead_letters::apply(admin, outbox, change, filter, "cli")
        .await
        .map_err(failure::store(verb))?;
    println!("{affected} dead letter(s) {done}");
    Ok(())
}

/// Ask on the terminal; refuse when there is none to ask on.
fn confirm(question: &str) -> Result<(), Failure> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Failure::config(format!(
            "refusing to {} without confirmation: standard input is not a terminal; pass --yes (or --dry-run to only look)",
            question.trim_end_matches('?')
        )));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Failure::runtime(format!("reading the answer: {e}")))?;
    match answer.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" => Ok(()),
        _ => Err(Failure::runtime("not confirmed; nothing changed")),
    }
}

fn print_table(letters: &[DeadLetter]) {
    println!(
        "{:<36}  {:<24}  {:<28}  {:>8}  {:<20}  LAST ERROR",
        "ID", "EVENT TYPE", "AGGREGATE", "ATTEMPTS", "DEAD AT"
    );
    for l in letters {
        let e = &l.event;
        println!(
            "{:<36}  {:<24}  {:<28}  {:>8}  {:<20}  {}",
            e.id,
            clip(&e.event_type, 24),
            clip(&format!("{}/{}", e.aggregate_type, e.aggregate_id), 28),
            e.attempts,
            l.dead_at.format("%Y-%m-%d %H:%M:%S"),
            clip(l.last_error.as_deref().unwrap_or("-"), 80)
        );
    }
}

/// At most `max` characters, with `…` when cut; newlines flattened.
fn clip(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

fn to_json(outbox: &str, letter: &DeadLetter) -> serde_json::Value {
    let e = &letter.event;
    let payload: serde_json::Value =
        serde_json::from_str(e.payload.get()).unwrap_or(serde_json::Value::Null);
    json!({
        "outbox": outbox,
        "id": e.id,
        "aggregate_type": e.aggregate_type,
        "aggregate_id": e.aggregate_id,
        "event_type": e.event_type,
        "attempts": e.attempts,
        "created_at": e.created_at,
        "dead_at": letter.dead_at,
        "destination": e.destination,
        "last_error": letter.last_error,
        "headers": e.headers,
        "payload": payload,
    })
}

#[cfg(test)]
mod tests {
    use super::{clip, shown_payload};

    #[test]
    fn clip_cuts_and_flattens() {
        assert_eq!(clip("abc", 5), "abc");
        assert_eq!(clip("abcdef", 4), "abc…");
        assert_eq!(clip("a\nb", 5), "a b");
    }

    #[test]
    fn a_large_payload_is_cut_at_a_character_with_its_size() {
        assert_eq!(shown_payload("{}", 10), "{}");
        let payload = format!("\"{}\"", "é".repeat(10));
        let shown = shown_payload(&payload, 4);
        assert!(shown.starts_with("\"é..."), "{shown}");
        assert!(shown.contains("22 bytes in all"), "{shown}");
    }
}
