//! The query plans of the relay's hot path, as PostgreSQL would run them under a
//! cached generic plan: what `tests/plans.rs` checks in every statistics state.

use sqlx::Row;

use crate::error::Result;
use crate::sql::{self, Sql};
use crate::testing::TestOutbox;

/// One hot-path statement and arguments to run it with (SQL literals).
struct HotStatement<'a> {
    name: &'static str,
    sql: &'a str,
    args: &'static str,
}

const KEYS: &str = "ARRAY['order'], ARRAY['a1']";
const UUIDS: &str = "ARRAY['00000000-0000-0000-0000-000000000001'::uuid]";
/// Ids, errors, delays, dead flags of a failure record (one retry).
const FAILURE: &str = "ARRAY['00000000-0000-0000-0000-000000000001'::uuid], ARRAY['e'], \
    ARRAY[1.0::float8], ARRAY[false]";
/// The same with the event dead-lettered.
const DEAD_FAILURE: &str = "ARRAY['00000000-0000-0000-0000-000000000001'::uuid], ARRAY['e'], \
    ARRAY[1.0::float8], ARRAY[true]";

fn hot_path(sql: &Sql) -> Vec<HotStatement<'_>> {
    vec![
        HotStatement {
            name: "claim_unordered",
            sql: &sql.claim_unordered,
            args: "200",
        },
        HotStatement {
            name: "claim_aggregates",
            sql: &sql.claim_aggregates,
            args: "200, 1600, 12, 1, 1, 4",
        },
        HotStatement {
            name: "claim_runs",
            sql: &sql.claim_runs,
            args: "ARRAY['order'], ARRAY['a1'], 1, 1000, ARRAY['order'], ARRAY['a2']",
        },
        HotStatement {
            name: "walk_front",
            sql: &sql.walk_front,
            args: "1",
        },
        HotStatement {
            name: "hold",
            sql: &sql.hold,
            args: "ARRAY['order'], ARRAY['a1'], ARRAY[now()]",
        },
        HotStatement {
            name: "unhold",
            sql: &sql.unhold,
            args: KEYS,
        },
        HotStatement {
            name: "delete_published",
            sql: &sql.delete_published,
            args: UUIDS,
        },
        HotStatement {
            name: "mark_published",
            sql: &sql.mark_published,
            args: UUIDS,
        },
        HotStatement {
            name: "record_failures",
            sql: &sql.record_failures,
            args: FAILURE,
        },
        HotStatement {
            name: "record_failures_release",
            sql: &sql.record_failures_release,
            args: FAILURE,
        },
        HotStatement {
            name: "record_failures_block",
            sql: &sql.record_failures_block,
            args: DEAD_FAILURE,
        },
        HotStatement {
            name: "count_pending",
            sql: sql::unguarded(&sql.count_pending),
            args: "",
        },
        HotStatement {
            name: "probe_due_unordered (in the probe function)",
            sql: &sql.probe_due_unordered_query,
            args: "",
        },
        HotStatement {
            name: "probe_due_ordered (in the probe function)",
            sql: &sql.probe_due_ordered_query,
            args: "1",
        },
    ]
}

impl TestOutbox {
    /// `EXPLAIN (VERBOSE, FORMAT JSON)` (each node's output expressions included) of
    /// every statement on the relay's hot path (claims, records, holds, wake-up
    /// probes, pending count), each prepared and explained as a relay's transaction
    /// runs it (the store's planner settings applied) with `plan_cache_mode =
    /// force_generic_plan`: the plan a cached prepared statement would use, whatever
    /// the table statistics say. Nothing is executed.
    pub async fn explain_hot_path(&self) -> Result<Vec<(&'static str, serde_json::Value)>> {
        let sql = self.outbox.sql();
        let mut conn = self.pool.acquire().await?;
        let mut plans = Vec::new();
        for statement in hot_path(sql) {
            sqlx::raw_sql(&format!("PREPARE outbox_explain AS {}", statement.sql))
                .execute(&mut *conn)
                .await?;
            let args = if statement.args.is_empty() {
                String::new()
            } else {
                format!("({})", statement.args)
            };
            let explain = format!(
                "{}; SET LOCAL plan_cache_mode = force_generic_plan; \
                 EXPLAIN (VERBOSE, FORMAT JSON) EXECUTE outbox_explain{args}",
                sql::BEGIN
            );
            let plan = sqlx::raw_sql(&explain).fetch_one(&mut *conn).await;
            sqlx::raw_sql("ROLLBACK; DEALLOCATE outbox_explain")
                .execute(&mut *conn)
                .await?;
            let plan: String = plan?.try_get_unchecked(0)?;
            let plan = serde_json::from_str(&plan).map_err(|e| {
                crate::Error::InvalidConfig(format!("EXPLAIN of {}: {e}", statement.name))
            })?;
            plans.push((statement.name, plan));
        }
        Ok(plans)
    }
}
