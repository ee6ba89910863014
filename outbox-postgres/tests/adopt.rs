//! Adopting the seed's outbox table in place, against the real PostgreSQL: the
//! adopted table ends in the very shape of a migrated one, a second adoption and a
//! dry run change nothing, and a table of neither layout is refused, unchanged.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use pgoutbox_postgres::testing::{create_seed_outbox, database_url, seed_insert};
use pgoutbox_postgres::{adopt, adoption_plan, migrate, AdoptOptions, Error, Tables};
use sqlx::PgPool;
use uuid::Uuid;

async fn pool() -> PgPool {
    PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL at DATABASE_URL")
}

async fn drop_schema(pool: &PgPool, tables: &Tables) {
    sqlx::raw_sql(&format!("DROP SCHEMA {} CASCADE", tables.schema().quoted()))
        .execute(pool)
        .await
        .unwrap();
}

/// Everything the catalog says about the outbox in `tables`' schema, one sorted
/// line per fact, the schema's name blanked: the events table's columns (name,
/// type, NOT NULL, default, identity; not their order), indexes, constraints,
/// triggers and `seq`'s sequence options; every relation, view definition and
/// function of the schema; the migrations recorded.
async fn catalog(pool: &PgPool, tables: &Tables) -> Vec<String> {
    let events = format!("{}.{}", tables.schema().quoted(), tables.events().quoted());
    let migrations = format!(
        "{}.\"{}_migrations\"",
        tables.schema().quoted(),
        tables.events()
    );
    let lines: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT 'column ' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod) \
           || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END \
           || COALESCE(' default ' || pg_get_expr(d.adbin, d.adrelid), '') \
           || CASE a.attidentity::text WHEN 'a' THEN ' identity always' WHEN 'd' THEN ' identity' ELSE '' END \
         FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
         WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped \
         UNION ALL SELECT 'index ' || pg_get_indexdef(i.indexrelid) \
           || CASE WHEN i.indisvalid THEN '' ELSE ' INVALID' END \
         FROM pg_index i WHERE i.indrelid = $1::regclass \
         UNION ALL SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(oid) \
           || CASE WHEN convalidated THEN '' ELSE ' (not validated)' END \
         FROM pg_constraint WHERE conrelid = $1::regclass \
         UNION ALL SELECT 'trigger ' || tgname FROM pg_trigger \
         WHERE tgrelid = $1::regclass AND NOT tgisinternal \
         UNION ALL SELECT 'seq sequence ' || seqtypid::regtype || ' increment ' || seqincrement \
           || ' cache ' || seqcache || ' cycle ' || seqcycle \
         FROM pg_sequence WHERE seqrelid = pg_get_serial_sequence($1, 'seq')::regclass \
         UNION ALL SELECT 'relation ' || c.relkind::text || ' ' || c.relname \
           || CASE WHEN c.relkind = 'v' THEN ' ' || pg_get_viewdef(c.oid) ELSE '' END \
         FROM pg_class c WHERE c.relnamespace = $2::regnamespace \
         UNION ALL SELECT 'function ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) \
           || ') ' || p.prosrc FROM pg_proc p WHERE p.pronamespace = $2::regnamespace \
         UNION ALL SELECT 'migration ' || version || ' ' || name FROM {migrations}"
    ))
    .bind(&events)
    .bind(tables.schema().as_str())
    .fetch_all(pool)
    .await
    .unwrap();
    let mut lines: Vec<String> = lines
        .into_iter()
        .map(|l| l.replace(tables.schema().as_str(), "SCHEMA"))
        .collect();
    lines.sort();
    lines
}

/// The columns, indexes, constraints and relations of the schema, before the
/// outbox is migrated (no migrations table to read yet).
async fn shape(pool: &PgPool, tables: &Tables) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relkind::text || ' ' || c.relname || ' ' || COALESCE(( \
           SELECT string_agg(a.attname || ':' || format_type(a.atttypid, a.atttypmod) \
             || ':' || a.attnotnull || ':' || COALESCE(pg_get_expr(d.adbin, d.adrelid), ''), ',' \
             ORDER BY a.attnum) \
           FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
           WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '') \
           || COALESCE(' ' || pg_get_indexdef(c.oid), '') \
         FROM pg_class c WHERE c.relnamespace = $1::regnamespace ORDER BY 1",
    )
    .bind(tables.schema().as_str())
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Rows of the seed's table, every column as text, in a stable order.
async fn rows(pool: &PgPool, tables: &Tables) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT t::text FROM {}.outbox_events t ORDER BY id",
        tables.schema().quoted()
    ))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Write `n` events with the seed's producer statement, one transaction each.
async fn seed_events(pool: &PgPool, tables: &Tables, n: usize) {
    let insert = seed_insert(tables.schema());
    for i in 0..n {
        sqlx::query(&insert)
            .bind("order")
            .bind(format!("{}", i % 7))
            .bind("order.created")
            .bind(serde_json::json!({ "n": i }))
            .execute(pool)
            .await
            .unwrap();
    }
}

/// An adopted seed table and a freshly migrated outbox end with the same columns,
/// types, defaults, indexes, constraints, views, functions and migrations; the
/// seed's producer writes into it; adopting again changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_adopted_table_has_the_shape_of_a_migrated_one_and_adopting_twice_is_a_no_op() {
    let pool = pool().await;
    let seed = create_seed_outbox(&pool).await.unwrap();
    seed_events(&pool, &seed, 20).await;
    let plan = adoption_plan(&pool, &seed, &AdoptOptions::default())
        .await
        .unwrap();
    assert!(!plan.already_migrated);
    assert_eq!(plan.pending, 20);
    assert_eq!(
        plan.add_columns,
        [
            "seq",
            "headers",
            "destination",
            "available_at",
            "dead_at",
            "last_error"
        ]
    );
    assert_eq!(
        plan.retype_columns,
        ["aggregate_type", "aggregate_id", "event_type"]
    );
    assert_eq!(plan.drop_indexes, ["idx_outbox_unprocessed"]);
    let text = plan.to_string();
    assert!(text.contains("20 pending"), "{text}");

    let done = adopt(&pool, &seed, &AdoptOptions::default()).await.unwrap();
    assert_eq!(done.exclusive_lock_held.len(), 2, "{done}");
    assert!(done
        .to_string()
        .contains("the table was locked (writers waiting) for"));
    let mut without_locks = done.clone();
    without_locks.exclusive_lock_held.clear();
    assert_eq!(without_locks, plan);

    let fresh = Tables::in_schema(&format!("outbox_test_{}", Uuid::new_v4().simple())).unwrap();
    migrate(&pool, &fresh).await.unwrap();
    let (adopted, migrated) = (catalog(&pool, &seed).await, catalog(&pool, &fresh).await);
    assert_eq!(adopted, migrated);
    assert!(adopted
        .iter()
        .any(|l| l.starts_with("column seq bigint not null identity always")));

    // Numbered in insertion order (created_at, id), continued by new events.
    seed_events(&pool, &seed, 1).await;
    let numbered: Vec<(i64, serde_json::Value)> = sqlx::query_as(&format!(
        "SELECT seq, payload FROM {}.outbox_events ORDER BY seq",
        seed.schema().quoted()
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    let ns: Vec<i64> = numbered
        .iter()
        .map(|(_, p)| p["n"].as_i64().unwrap())
        .collect();
    assert_eq!(ns, (0..20).chain(0..1).collect::<Vec<_>>());
    assert_eq!(numbered[19].0, 20);

    // Again: a no-op.
    let before = catalog(&pool, &seed).await;
    let again = adopt(&pool, &seed, &AdoptOptions::default()).await.unwrap();
    assert!(again.already_migrated);
    assert!(again.to_string().contains("nothing to adopt"), "{again}");
    assert_eq!(catalog(&pool, &seed).await, before);
    drop_schema(&pool, &seed).await;
    drop_schema(&pool, &fresh).await;
}

/// A dry run changes nothing; a table of neither layout is refused with the
/// missing and conflicting columns named, and is left as it was.
#[tokio::test(flavor = "multi_thread")]
async fn a_dry_run_and_a_refused_adoption_change_nothing() {
    let pool = pool().await;
    let seed = create_seed_outbox(&pool).await.unwrap();
    seed_events(&pool, &seed, 5).await;
    let (before, data) = (shape(&pool, &seed).await, rows(&pool, &seed).await);
    let plan = adoption_plan(&pool, &seed, &AdoptOptions::default())
        .await
        .unwrap();
    assert_eq!(plan.pending, 5);
    assert_eq!(shape(&pool, &seed).await, before);
    assert_eq!(rows(&pool, &seed).await, data);

    // Another layout: `aggregate` instead of `aggregate_id`, JSON as json, a
    // serial id, a NOT NULL column nobody writes.
    let other = Tables::in_schema(&format!("outbox_test_{}", Uuid::new_v4().simple())).unwrap();
    let table = format!("{}.outbox_events", other.schema().quoted());
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {schema}; CREATE TABLE {table} (id bigserial PRIMARY KEY, \
         aggregate_type text NOT NULL, aggregate text NOT NULL, event_type text NOT NULL, \
         payload json NOT NULL, attempts int NOT NULL DEFAULT 0, \
         created_at timestamptz NOT NULL DEFAULT now(), processed_at timestamptz, \
         tenant text NOT NULL); \
         INSERT INTO {table} (aggregate_type, aggregate, event_type, payload, tenant) \
         VALUES ('order', '1', 'order.created', '{{}}', 'acme')",
        schema = other.schema().quoted()
    ))
    .execute(&pool)
    .await
    .unwrap();
    let (before_other, data_other) = (shape(&pool, &other).await, rows(&pool, &other).await);
    for dry_run in [true, false] {
        let err = if dry_run {
            adoption_plan(&pool, &other, &AdoptOptions::default())
                .await
                .unwrap_err()
        } else {
            adopt(&pool, &other, &AdoptOptions::default())
                .await
                .unwrap_err()
        };
        let message = err.to_string();
        assert!(matches!(err, Error::CannotAdopt { .. }), "{message}");
        for needle in [
            "missing column(s): aggregate_id",
            "id is bigint (needs uuid)",
            "payload is json (needs jsonb)",
            "tenant is NOT NULL without a default",
            "nothing was changed",
        ] {
            assert!(message.contains(needle), "{needle:?} not in: {message}");
        }
    }
    assert_eq!(shape(&pool, &other).await, before_other);
    assert_eq!(rows(&pool, &other).await, data_other);
    let migrations_table = format!("{}.outbox_events_migrations", other.schema());
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&migrations_table)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!exists, "a refused adoption recorded a migration");

    // No table at all: refused, saying how to create one.
    let missing = Tables::in_schema("outbox_test_no_such_schema").unwrap();
    let err = adopt(&pool, &missing, &AdoptOptions::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("there is no such table"), "{err}");
    drop_schema(&pool, &seed).await;
    drop_schema(&pool, &other).await;
}

/// A transaction that keeps the table locked makes the adoption give up after its
/// tries, naming the table, with nothing changed; writers are never held longer
/// than one try's `lock_timeout`; once the transaction ends, the adoption runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_long_transaction_makes_the_adoption_wait_not_the_writers() {
    use sqlx::Connection;

    let pool = pool().await;
    let seed = create_seed_outbox(&pool).await.unwrap();
    seed_events(&pool, &seed, 3).await;
    // A primary key of another name: the adoption gives it migration 1's.
    sqlx::raw_sql(&format!(
        "ALTER TABLE {}.outbox_events RENAME CONSTRAINT outbox_events_pkey TO \"Seed PK\"",
        seed.schema().quoted()
    ))
    .execute(&pool)
    .await
    .unwrap();
    let before = shape(&pool, &seed).await;
    // A report reading the table in a transaction left open.
    let mut report = sqlx::PgConnection::connect(&database_url()).await.unwrap();
    sqlx::raw_sql(&format!(
        "BEGIN; SELECT count(*) FROM {}.outbox_events",
        seed.schema().quoted()
    ))
    .execute(&mut report)
    .await
    .unwrap();

    let options = AdoptOptions::default().lock_timeout(std::time::Duration::from_millis(50), 3);
    // Meanwhile (in the same task) a producer writes: each INSERT waits at most
    // about one try's timeout.
    let done = std::sync::atomic::AtomicBool::new(false);
    let adoption = async {
        let result = adopt(&pool, &seed, &options).await;
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        result
    };
    let insert = seed_insert(seed.schema());
    let producer = async {
        let mut longest = std::time::Duration::ZERO;
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            let started = std::time::Instant::now();
            sqlx::query(&insert)
                .bind("order")
                .bind("live")
                .bind("order.created")
                .bind(serde_json::json!({}))
                .execute(&pool)
                .await
                .unwrap();
            longest = longest.max(started.elapsed());
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        longest
    };
    let (result, longest) = tokio::join!(adoption, producer);
    let err = result.unwrap_err();
    assert!(matches!(err, Error::LockNotFree { tries: 3, .. }), "{err}");
    assert!(err.to_string().contains("outbox_events"), "{err}");
    assert!(
        longest < std::time::Duration::from_secs(1),
        "a writer waited {longest:?}"
    );
    assert_eq!(
        shape(&pool, &seed).await,
        before,
        "the refused step changed the table"
    );

    sqlx::raw_sql("COMMIT").execute(&mut report).await.unwrap();
    let done = adopt(&pool, &seed, &options).await.unwrap();
    assert!(!done.already_migrated);
    let primary_key: String = sqlx::query_scalar(
        "SELECT conname::text FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'p'",
    )
    .bind(format!("{}.outbox_events", seed.schema().quoted()))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(primary_key, "outbox_events_pkey");
    drop_schema(&pool, &seed).await;
}
