//! Every statement on the relay's hot path keeps to index scans under a cached
//! generic plan, whatever the table statistics say: never analysed, analysed while
//! empty (as autovacuum leaves a queue table that delete-on-publish empties), and
//! analysed while full.
#![allow(clippy::unwrap_used)]

mod common;

use pgoutbox_postgres::testing::TestOutbox;
use serde_json::Value;

/// Plan nodes that read a whole table (or every row of an index's range, unordered).
const SCANS_OF_EVERYTHING: &[&str] = &["Seq Scan", "Bitmap Heap Scan"];

/// Call `visit` on every node of an `EXPLAIN (FORMAT JSON)` plan.
fn for_each_node(plan: &Value, visit: &mut impl FnMut(&serde_json::Map<String, Value>)) {
    match plan {
        Value::Object(node) => {
            visit(node);
            node.values().for_each(|v| for_each_node(v, visit));
        }
        Value::Array(items) => items.iter().for_each(|v| for_each_node(v, visit)),
        _ => {}
    }
}

/// A plan node's type and relation, when it scans a relation.
fn scan_of(node: &serde_json::Map<String, Value>) -> Option<(&str, &str)> {
    let kind = node.get("Node Type").and_then(Value::as_str)?;
    let relation = node.get("Relation Name").and_then(Value::as_str)?;
    Some((kind, relation))
}

/// `(node type, relation)` of every plan node that scans a whole outbox table.
fn whole_table_scans(plan: &Value, tables: &[&str], found: &mut Vec<String>) {
    for_each_node(plan, &mut |node| {
        if let Some((kind, relation)) = scan_of(node) {
            if SCANS_OF_EVERYTHING.contains(&kind) && tables.contains(&relation) {
                found.push(format!("{kind} on {relation}"));
            }
        }
    });
}

/// The first column of an index of the events table.
fn leading_column(index: &str) -> Option<&'static str> {
    [
        ("_pending_idx", "seq"),
        ("_aggregate_idx", "aggregate_type"),
        ("_processed_idx", "processed_at"),
        ("_pkey", "id"),
    ]
    .into_iter()
    .find(|(suffix, _)| index.ends_with(suffix))
    .map(|(_, column)| column)
}

/// Index scans of the events table whose condition does not bound the index's
/// first column: a walk of the whole index (a B-tree takes conditions on later
/// columns too, checking them against every entry, those of published events that
/// vacuum has not removed included). Run once per row of another node (a subquery's
/// plan, the inner side of a join), it is what a disabled sequential scan turns into
/// when no index fits the probe; run once, it is an index the planner preferred to
/// the one that fits the range (an `EXISTS` whose order it dropped read the whole
/// aggregate index for `seq >= start`).
fn unbounded_probes(plan: &Value, found: &mut Vec<String>) {
    for_each_node(plan, &mut |node| {
        let per_row = matches!(
            node.get("Parent Relationship").and_then(Value::as_str),
            Some("SubPlan" | "Inner")
        );
        let Some((kind, "outbox_events")) = scan_of(node) else {
            return;
        };
        if !kind.starts_with("Index") {
            return;
        }
        let index = node
            .get("Index Name")
            .and_then(Value::as_str)
            .unwrap_or("?");
        let cond = node.get("Index Cond").and_then(Value::as_str).unwrap_or("");
        // The dead-letter index holds dead letters only (an operators' count reads
        // it whole): none of its entries is a published event's.
        let bounded = index.ends_with("_dead_idx")
            || leading_column(index).is_some_and(|column| {
                cond.contains(&format!(".{column} ")) || cond.contains(&format!("({column} "))
            });
        if !bounded {
            let how = if per_row { "per row" } else { "once" };
            found.push(format!("{kind} using {index} {how}, condition {cond:?}"));
        }
    });
}

/// Reads of the whole holds table: an index scan of it with no condition, other
/// than the one-row look of an init plan ("is anything held at all"). A hashed
/// subplan or a hash join builds its table from such a scan once per statement,
/// so a claim would cost O(holds): cheap while few aggregates are held, about
/// 10 ms a claim with 20,000 held during a long partial outage.
fn whole_holds_reads(plan: &Value, found: &mut Vec<String>) {
    for_each_node(plan, &mut |node| {
        let Some((kind, "outbox_events_held")) = scan_of(node) else {
            return;
        };
        let once = node.get("Parent Relationship").and_then(Value::as_str) == Some("InitPlan");
        if kind.starts_with("Index") && node.get("Index Cond").is_none() && !once {
            let name = node
                .get("Subplan Name")
                .and_then(Value::as_str)
                .unwrap_or("");
            found.push(format!("{kind} of every hold {name}"));
        }
    });
}

/// Aggregates computed straight over an index scan of an outbox table: a `min()`
/// or `count()` that reads the whole index (a generic plan without statistics
/// does not turn `min()` into a first-row probe).
fn aggregates_over_scans(plan: &Value, tables: &[&str], found: &mut Vec<String>) {
    for_each_node(plan, &mut |node| {
        if node.get("Node Type").and_then(Value::as_str) != Some("Aggregate") {
            return;
        }
        let children = node.get("Plans").and_then(Value::as_array);
        for (kind, relation) in children
            .into_iter()
            .flatten()
            .filter_map(|c| c.as_object().and_then(scan_of))
        {
            if kind.starts_with("Index") && tables.contains(&relation) {
                found.push(format!("Aggregate over {kind} on {relation}"));
            }
        }
    });
}

/// The state a drain leaves under a held snapshot: 5,000 events published
/// (deleted) while another session held a snapshot, then vacuumed, which removes
/// none of them but records the table as holding almost no live rows. Returns the
/// session holding the snapshot.
async fn drained_under_a_held_snapshot(db: &TestOutbox) -> sqlx::PgConnection {
    use sqlx::Connection;
    let mut holder = sqlx::PgConnection::connect(&pgoutbox_postgres::testing::database_url())
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .execute(&mut holder)
        .await
        .unwrap();
    common::fill(db, 10, 500).await;
    let events = format!("{}.outbox_events", db.tables.schema().quoted());
    for statement in [format!("DELETE FROM {events}"), format!("VACUUM {events}")] {
        sqlx::raw_sql(&statement).execute(&db.pool).await.unwrap();
    }
    holder
}

async fn analyze(db: &TestOutbox) {
    for table in ["outbox_events", "outbox_events_held"] {
        sqlx::query(&format!("ANALYZE {}.{table}", db.tables.schema().quoted()))
            .execute(&db.pool)
            .await
            .unwrap();
    }
}

/// Problems with where the ordered claim's walk reads each row's xmax: only inside
/// the expression that takes the row's aggregate lock (in its branch after the
/// lock), evaluated by the index scan of the events table. A plan that read the
/// xmax anywhere else (a column of the scan passed up to a node that takes the
/// lock) would read it before the lock, and miss a change another relay committed
/// in between.
fn xmax_read_before_lock(plan: &Value) -> Vec<String> {
    let mut found = Vec::new();
    let mut locked_reads_in_scan = 0;
    for_each_node(plan, &mut |node| {
        let outputs = node.get("Output").and_then(Value::as_array);
        let scan = scan_of(node);
        for output in outputs.into_iter().flatten().filter_map(Value::as_str) {
            let Some(xmax) = output.find("xmax") else {
                continue;
            };
            match output.find("pg_try_advisory_xact_lock") {
                Some(lock) if lock < xmax => {
                    // Nodes above the scan show its expression again (their input).
                    if matches!(scan, Some((kind, "outbox_events")) if kind.starts_with("Index")) {
                        locked_reads_in_scan += 1;
                    }
                }
                _ => found.push(format!("{scan:?} outputs {output}")),
            }
        }
    });
    if locked_reads_in_scan != 1 {
        found.push(format!(
            "the index scan of outbox_events evaluates {locked_reads_in_scan} expressions \
             that lock and then read xmax (expected 1)"
        ));
    }
    found
}

async fn assert_index_only_plans(db: &TestOutbox, state: &str) {
    let plans = db.explain_hot_path().await.unwrap();
    assert!(plans.len() >= 10, "every hot-path statement explained");
    for (name, plan) in plans {
        let mut found = Vec::new();
        let tables = ["outbox_events", "outbox_events_held"];
        // Counting the pending events reads them all by design, and every hold
        // (the events of held aggregates below the walk start are counted per hold);
        // the operators' counts too, beside the dead letters and recent events.
        let counts = name.starts_with("count_");
        whole_table_scans(
            &plan,
            if counts { &tables[..1] } else { &tables },
            &mut found,
        );
        if !counts {
            aggregates_over_scans(&plan, &tables, &mut found);
        }
        unbounded_probes(&plan, &mut found);
        if !counts {
            whole_holds_reads(&plan, &mut found);
        }
        assert!(
            found.is_empty(),
            "{state}: {name} scans a whole table (or index, per row) under a generic plan: {found:?}\n{plan:#}"
        );
        if name == "claim_aggregates" {
            let found = xmax_read_before_lock(&plan);
            assert!(
                found.is_empty(),
                "{state}: the ordered walk reads xmax where it may precede the lock: {found:?}\n{plan:#}"
            );
        }
    }
}

/// The three statistics states a production queue table goes through; 5,000 pending
/// events over 10 aggregates (a hot-key backlog) in each.
#[tokio::test]
async fn hot_path_plans_use_indexes_in_every_statistics_state() {
    // Never analysed.
    let db = TestOutbox::new().await.unwrap();
    common::fill(&db, 10, 500).await;
    assert_index_only_plans(&db, "never analysed").await;
    db.drop_schema().await.unwrap();

    // Analysed while empty, then filled.
    let db = TestOutbox::new().await.unwrap();
    analyze(&db).await;
    common::fill(&db, 10, 500).await;
    assert_index_only_plans(&db, "analysed while empty").await;
    db.drop_schema().await.unwrap();

    // Analysed while full.
    let db = TestOutbox::new().await.unwrap();
    common::fill(&db, 10, 500).await;
    analyze(&db).await;
    assert_index_only_plans(&db, "analysed while full").await;
    db.drop_schema().await.unwrap();

    // Vacuumed after a drain while a snapshot was held, then filled again.
    let db = TestOutbox::new().await.unwrap();
    let holder = drained_under_a_held_snapshot(&db).await;
    common::fill(&db, 10, 500).await;
    assert_index_only_plans(&db, "vacuumed under a held snapshot").await;
    drop(holder);
    db.drop_schema().await.unwrap();
}

/// The plan `explain` (an `EXPLAIN (FORMAT JSON)` statement, after the settings it
/// needs, all in one transaction) returns, the transaction rolled back and
/// `cleanup` run after it.
async fn explained(db: &TestOutbox, explain: &str, cleanup: &str) -> Value {
    let mut conn = db.pool.acquire().await.unwrap();
    // EXPLAIN's column is `json`; over the simple protocol it comes as text.
    let plan: String = sqlx::Row::try_get_unchecked(
        &sqlx::raw_sql(&format!("BEGIN; {explain}"))
            .fetch_one(&mut *conn)
            .await
            .unwrap(),
        0,
    )
    .unwrap();
    sqlx::raw_sql(&format!("ROLLBACK; {cleanup}"))
        .execute(&mut *conn)
        .await
        .unwrap();
    serde_json::from_str(&plan).unwrap()
}

/// The check can fail: on a statement with no index to use (event types are not
/// indexed), the same detector finds the sequential scan in PostgreSQL's output.
#[tokio::test]
async fn the_plan_check_sees_a_sequential_scan() {
    let db = TestOutbox::new().await.unwrap();
    common::fill(&db, 10, 500).await;
    let events = format!("{}.outbox_events", db.tables.schema().quoted());
    let explain = format!(
        "SET LOCAL enable_seqscan = off; \
         EXPLAIN (FORMAT JSON) SELECT count(*) FROM {events} WHERE event_type = 'x'"
    );
    let plan = explained(&db, &explain, "").await;
    let mut found = Vec::new();
    whole_table_scans(&plan, &["outbox_events"], &mut found);
    assert_eq!(found, ["Seq Scan on outbox_events"], "{plan:#}");
    db.drop_schema().await.unwrap();
}

/// The check can fail: an `EXISTS` over `seq >= start` (the wake-up probe's first
/// form) is planned, on a table vacuumed after a drain while a snapshot was held,
/// as a read of the whole aggregate index, and the detector finds it.
#[tokio::test]
async fn the_plan_check_sees_a_whole_index_read_for_a_range() {
    let db = TestOutbox::new().await.unwrap();
    let holder = drained_under_a_held_snapshot(&db).await;
    let events = format!("{}.outbox_events", db.tables.schema().quoted());
    let explain = format!(
        "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
         SET LOCAL enable_sort = off; SET LOCAL plan_cache_mode = force_generic_plan; \
         PREPARE outbox_exists(int8) AS SELECT EXISTS (SELECT 1 FROM {events} e \
         WHERE e.processed_at IS NULL AND e.dead_at IS NULL AND e.seq >= $1 \
         AND e.available_at <= now()); \
         EXPLAIN (FORMAT JSON) EXECUTE outbox_exists(10)"
    );
    let plan = explained(&db, &explain, "DEALLOCATE outbox_exists").await;
    let mut found = Vec::new();
    unbounded_probes(&plan, &mut found);
    assert_eq!(
        found,
        ["Index Scan using outbox_events_aggregate_idx once, condition \"(seq >= $1)\""],
        "{plan:#}"
    );
    drop(holder);
    db.drop_schema().await.unwrap();
}
