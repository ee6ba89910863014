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
/// The same, holding its aggregate (ordered), with the claim's walk start.
const FAILURE_HOLDING: &str = "ARRAY['00000000-0000-0000-0000-000000000001'::uuid], \
    ARRAY['e'], ARRAY[1.0::float8], ARRAY[false], 1";
/// The same with the event dead-lettered.
const DEAD_FAILURE_HOLDING: &str = "ARRAY['00000000-0000-0000-0000-000000000001'::uuid], \
    ARRAY['e'], ARRAY[1.0::float8], ARRAY[true], 1";

fn hot_path(sql: &Sql) -> Vec<HotStatement<'_>> {
    vec![
        HotStatement {
            name: "claim_unordered",
            sql: &sql.claim_unordered,
            args: "200, 1",
        },
        HotStatement {
            name: "claim_aggregates",
            sql: &sql.claim_aggregates,
            args: "200, 1600, 12, 1, 1, 4",
        },
        HotStatement {
            name: "claim_runs",
            sql: &sql.claim_runs,
            args: "ARRAY['order'], ARRAY['a1'], 1, 1000, ARRAY['order'], ARRAY['a2'], \
                   ARRAY[1::int8], 16",
        },
        HotStatement {
            name: "walk_front_ordered",
            sql: &sql.walk_front_ordered,
            args: "1",
        },
        HotStatement {
            name: "walk_front_unordered",
            sql: &sql.walk_front_unordered,
            args: "1",
        },
        HotStatement {
            name: "drop_expired_holds",
            sql: &sql.drop_expired_holds,
            args: "",
        },
        HotStatement {
            name: "hold",
            sql: &sql.hold,
            args: "ARRAY['order'], ARRAY['a1'], ARRAY[now()], ARRAY[1::int8]",
        },
        HotStatement {
            name: "unhold",
            sql: &sql.unhold,
            args: KEYS,
        },
        HotStatement {
            name: "advance_held",
            sql: &sql.advance_held,
            args: "ARRAY['order'], ARRAY['a1'], ARRAY[1::int8]",
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
            args: FAILURE_HOLDING,
        },
        HotStatement {
            name: "record_failures_block",
            sql: &sql.record_failures_block,
            args: DEAD_FAILURE_HOLDING,
        },
        HotStatement {
            name: "count_pending_ordered",
            sql: &sql.count_pending_ordered,
            args: "1",
        },
        HotStatement {
            name: "count_pending_unordered",
            sql: &sql.count_pending_unordered,
            args: "1",
        },
        HotStatement {
            name: "count_stats_ordered",
            sql: &sql.stats_ordered,
            args: "1",
        },
        HotStatement {
            name: "count_stats_unordered",
            sql: &sql.stats_unordered,
            args: "1",
        },
        HotStatement {
            name: "look_below_ordered",
            sql: &sql.look_below_ordered,
            args: "100",
        },
        HotStatement {
            name: "look_below_unordered",
            sql: &sql.look_below_unordered,
            args: "100",
        },
        HotStatement {
            name: "probe_due_unordered (in the probe function)",
            sql: &sql.probe_due_unordered_query,
            args: "1",
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

impl TestOutbox {
    /// Shared buffers (hit or read) that an ordered claim's walk (`claim_aggregates`,
    /// a batch of 100) and the ordered wake-up probe's query touch when they start at
    /// `walk_start`: each run once with `EXPLAIN (ANALYZE, BUFFERS)` as a relay's
    /// transaction runs it (planner settings applied), then rolled back. What a
    /// claim costs in pages, whatever the machine's speed.
    pub async fn walk_buffers(&self, walk_start: i64) -> Result<(i64, i64)> {
        let sql = self.outbox.sql();
        let walk = self
            .buffers_of(
                &sql.claim_aggregates,
                &format!("100, 800, 6, {walk_start}, NULL, NULL"),
            )
            .await?;
        let probe = self
            .buffers_of(&sql.probe_due_ordered_query, &walk_start.to_string())
            .await?;
        Ok((walk, probe))
    }

    async fn buffers_of(&self, statement: &str, args: &str) -> Result<i64> {
        let mut conn = self.pool.acquire().await?;
        sqlx::raw_sql(&format!("PREPARE outbox_buffers AS {statement}"))
            .execute(&mut *conn)
            .await?;
        let explain = format!(
            "{}; EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE outbox_buffers({args})",
            sql::BEGIN
        );
        let plan = sqlx::raw_sql(&explain).fetch_one(&mut *conn).await;
        sqlx::raw_sql("ROLLBACK; DEALLOCATE outbox_buffers")
            .execute(&mut *conn)
            .await?;
        let plan: String = plan?.try_get_unchecked(0)?;
        let plan: serde_json::Value = serde_json::from_str(&plan)
            .map_err(|e| crate::Error::InvalidConfig(format!("EXPLAIN ANALYZE: {e}")))?;
        let top = &plan[0]["Plan"];
        let blocks = |key: &str| top[key].as_i64().unwrap_or(0);
        Ok(blocks("Shared Hit Blocks") + blocks("Shared Read Blocks"))
    }
}
