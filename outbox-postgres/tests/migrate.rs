//! The schema applied by a migration tool of the user's own (the printed script) and
//! the inbox alone, against the real PostgreSQL.

use pgoutbox_core::{Claim, NewEvent, Store};
use pgoutbox_postgres::testing::database_url;
use pgoutbox_postgres::{
    inbox_script, migrate, migrate_inbox, migration_script, unapplied_migrations, Inbox, Outbox,
    PgStore, Tables,
};
use sqlx::PgPool;
use uuid::Uuid;

async fn pool() -> PgPool {
    PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL at DATABASE_URL")
}

/// Names of an outbox no other test uses: a fresh schema, non-default table names.
fn fresh_tables() -> Tables {
    let schema = format!("outbox_test_{}", Uuid::new_v4().simple());
    Tables::in_schema(&schema)
        .and_then(|t| t.with_events_table("shop_events"))
        .and_then(|t| t.with_inbox_table("shop_inbox"))
        .expect("valid names")
}

async fn drop_schema(pool: &PgPool, tables: &Tables) {
    sqlx::raw_sql(&format!("DROP SCHEMA {} CASCADE", tables.schema().quoted()))
        .execute(pool)
        .await
        .expect("drop schema");
}

/// The versions of the migrations not applied to `tables` yet.
async fn unapplied_versions(pool: &PgPool, tables: &Tables) -> Vec<i32> {
    unapplied_migrations(pool, tables)
        .await
        .expect("check")
        .into_iter()
        .map(|(version, _)| version)
        .collect()
}

async fn table_exists(pool: &PgPool, schema: &str, table: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL")
        .bind(schema)
        .bind(table)
        .fetch_one(pool)
        .await
        .expect("to_regclass")
}

/// The script, applied in one transaction as a migration tool would, gives an outbox
/// that `migrate` and the relay's startup check see as complete, and that works.
#[tokio::test]
async fn the_printed_script_is_a_complete_migration() {
    let pool = pool().await;
    let tables = fresh_tables();
    let script = migration_script(&tables, 0);
    assert!(script.contains("shop_events"), "{script}");

    let mut tx = pool.begin().await.expect("begin");
    sqlx::raw_sql(&script)
        .execute(&mut *tx)
        .await
        .expect("the script runs");
    tx.commit().await.expect("commit");

    assert_eq!(
        unapplied_migrations(&pool, &tables).await.expect("check"),
        Vec::new(),
        "the script records every migration it applies"
    );
    migrate(&pool, &tables)
        .await
        .expect("migrate after the script is a no-op");

    let outbox = Outbox::new(tables.clone());
    let event = NewEvent::new("order", "1", "order.created", &serde_json::json!({"n": 1}));
    let mut tx = pool.begin().await.expect("begin");
    outbox.enqueue(&mut tx, &event).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let store = PgStore::new(pool.clone(), tables.clone());
    let claim = store.claim(10).await.expect("claim");
    let claimed: Vec<Uuid> = claim.events().iter().map(|e| e.id).collect();
    assert_eq!(claimed, vec![event.id]);
    drop(claim);
    drop_schema(&pool, &tables).await;
}

/// An upgrade script holds only the migrations after the given version; applied
/// after the older ones, it completes the outbox.
#[tokio::test]
async fn an_upgrade_script_holds_only_the_later_migrations() {
    let pool = pool().await;
    let tables = fresh_tables();
    let full = migration_script(&tables, 0);
    let upgrade = migration_script(&tables, 2);
    assert!(full.contains("-- migration 1: outbox"), "{full}");
    assert!(!upgrade.contains("-- migration 1:"), "{upgrade}");
    assert!(!upgrade.contains("-- migration 2:"), "{upgrade}");
    assert!(upgrade.contains("-- migration 3:"), "{upgrade}");

    // Versions 1 and 2 as an older crate would have printed them: the full script
    // cut before migration 3.
    let cut = full
        .find("\n-- migration 3:")
        .expect("migration 3 in the script");
    sqlx::raw_sql(&full[..cut])
        .execute(&pool)
        .await
        .expect("versions 1-2");
    let missing = unapplied_versions(&pool, &tables).await;
    assert_eq!(missing, vec![3, 4, 5, 6, 7, 8, 9]);
    sqlx::raw_sql(&upgrade)
        .execute(&pool)
        .await
        .expect("the upgrade runs");
    assert_eq!(
        unapplied_migrations(&pool, &tables).await.expect("check"),
        Vec::new()
    );
    drop_schema(&pool, &tables).await;
}

/// A consumer-only service gets the inbox and nothing else; a later full migration
/// of the same names keeps it (and what it recorded).
#[tokio::test]
async fn the_inbox_alone_serves_a_consumer_and_survives_a_later_migrate() {
    let pool = pool().await;
    let tables = fresh_tables();
    migrate_inbox(&pool, &tables).await.expect("inbox");
    migrate_inbox(&pool, &tables).await.expect("idempotent");
    let schema = tables.schema().as_str().to_owned();
    assert!(table_exists(&pool, &schema, "shop_inbox").await);
    assert!(!table_exists(&pool, &schema, "shop_events").await);
    assert!(inbox_script(&tables).contains("shop_inbox"));

    let outbox = Outbox::new(tables.clone());
    let inbox = Inbox::new(&outbox, "billing").expect("consumer name");
    let event_id = Uuid::now_v7();
    let mut tx = pool.begin().await.expect("begin");
    assert!(
        inbox.record(&mut tx, event_id).await.expect("record"),
        "first delivery"
    );
    tx.commit().await.expect("commit");

    migrate(&pool, &tables)
        .await
        .expect("full migrate next to the inbox");
    assert!(table_exists(&pool, &schema, "shop_events").await);
    let mut tx = pool.begin().await.expect("begin");
    assert!(
        !inbox.record(&mut tx, event_id).await.expect("record"),
        "the inbox kept its record through the full migration"
    );
    tx.rollback().await.expect("rollback");
    drop_schema(&pool, &tables).await;
}

/// A database whose probe function was created by migration 4 as first released
/// (the holds check not fenced) gets the current one from migration 5: the wake-up
/// probe of an existing deployment stops reading every hold.
#[tokio::test]
async fn migration_5_replaces_a_probe_function_that_reads_every_hold() {
    let pool = pool().await;
    let tables = fresh_tables();
    let full = migration_script(&tables, 0);
    let cut = full
        .find("\n-- migration 5:")
        .expect("migration 5 in the script");
    // Versions 1-4 as released: the holds check unfenced.
    let fenced = "OFFSET 0))";
    assert!(!full[..cut].contains("OFFSET 0"), "{}", &full[..cut]);
    sqlx::raw_sql(&full[..cut])
        .execute(&pool)
        .await
        .expect("versions 1-4");
    let source = "SELECT p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
         WHERE n.nspname = $1 AND p.proname = $2";
    let probe_source = || async {
        sqlx::query_scalar::<_, String>(source)
            .bind(tables.schema().as_str())
            .bind(format!("{}_probe_due", tables.events()))
            .fetch_one(&pool)
            .await
            .expect("the probe function")
    };
    assert!(!probe_source().await.contains("OFFSET 0"));
    let missing = unapplied_versions(&pool, &tables).await;
    assert_eq!(missing, vec![5, 6, 7, 8, 9]);

    migrate(&pool, &tables)
        .await
        .expect("migrate to the latest");
    assert!(
        probe_source().await.contains(fenced),
        "{}",
        probe_source().await
    );
    drop_schema(&pool, &tables).await;
}
