//! The console of the `outbox` binary: the relay run as a process against the real
//! PostgreSQL, its pages driven in headless Chromium through chromedriver
//! (scripts/chromium.sh starts it and exports `OUTBOX_WEBDRIVER_URL`; without it
//! the browser test fails, saying so). The screenshots in docs/ come from here.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;
#[path = "common/webdriver.rs"]
mod webdriver;

use std::path::PathBuf;
use std::time::Duration;

use common::{
    dead_count, drop_schema, get, ids_where, poll, request, run_ok, Config, RelayProcess,
};
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{NewEvent, PublishError, Relay};
use pgoutbox_postgres::testing::{database_url, TestOutbox};
use pgoutbox_postgres::Tables;
use serde_json::{json, Value};
use uuid::Uuid;
use webdriver::Browser;

const TOKEN: &str = "s3cret-console-token";
/// The broker's refusal, as the dead letters keep it: markup to be shown as text,
/// and a URL whose password must never reach the page.
const REFUSAL: &str =
    "Refused by test <script>alert(2)</script> at amqp://app:hunter2@mq.internal:5672/%2f";
/// Bound of every wait for the relay or the page: generous for a loaded machine;
/// each wait ends as soon as what it waits for is there.
const LIMIT: Duration = Duration::from_secs(60);

/// Per aggregate of `heads`, an event the broker refuses for good (a dead letter,
/// with the head's payload) and a follower it holds back (ordering on, dead letters
/// block their aggregate): as many pending, held and dead. The heads' ids.
async fn dead_heads_with_followers(outbox: &TestOutbox, heads: &[(&str, Value)]) -> Vec<Uuid> {
    let mut events = Vec::new();
    for (aggregate, payload) in heads {
        events.push(NewEvent::new(
            "payment",
            *aggregate,
            "payment.refused",
            payload,
        ));
        events.push(NewEvent::new(
            "payment",
            *aggregate,
            "payment.follow",
            &json!({ "follows": aggregate }),
        ));
    }
    let mut tx = outbox.pool.begin().await.unwrap();
    let ids = outbox.outbox.enqueue_many(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::new(
        outbox.store(),
        RecordingPublisher::failing_when(|e| {
            (e.event_type == "payment.refused").then(|| PublishError::permanent(REFUSAL))
        }),
    );
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.dead_lettered, heads.len());
    ids.into_iter().step_by(2).collect()
}

/// A relay of `outbox` (stdout broker) with the console on, and its port;
/// `console` is the rest of the `[console]` section.
fn relay_with_console(outbox: &TestOutbox, console: &str) -> (Config, RelayProcess, u16) {
    let port = common::free_port();
    let config = Config::with_broker(
        outbox.tables.schema().as_str(),
        &format!("127.0.0.1:{port}"),
        &format!(
            "[broker]\nkind = \"stdout\"\n\n[console]\nenabled = true\nsample_interval = \"200ms\"\n{console}"
        ),
    );
    let relay = RelayProcess::start(&config.path);
    (config, relay, port)
}

async fn wait_until_serving(port: u16) {
    let up = poll(LIMIT, Duration::from_millis(100), async || {
        get(port, "/healthz").filter(|(status, _)| *status == 200)
    })
    .await;
    assert!(up.is_some(), "the relay's HTTP endpoint did not answer");
}

fn json_of(port: u16, path: &str) -> Value {
    let (status, body) = get(port, path).unwrap();
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// POST a dead-letter action with `headers`; (status, body).
fn act(port: u16, action: &str, headers: &[(&str, &str)], body: &Value) -> (u16, String) {
    let path = format!("/console/api/dead-letters/{action}");
    request(port, "POST", &path, headers, Some(&body.to_string())).unwrap()
}

fn docs(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../docs")
        .join(file)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_sees_the_backlog_and_fixes_dead_letters_in_a_browser() {
    let outbox = TestOutbox::new().await.unwrap();
    let script_payload = json!({ "note": "<script>alert(1)</script>", "amount": 5 });
    let heads = dead_heads_with_followers(
        &outbox,
        &[
            ("a", script_payload),
            ("b", json!({ "amount": 7 })),
            ("c", json!({ "amount": 9 })),
        ],
    )
    .await;
    let (retried, purged) = (heads[0], heads[1]);
    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("console-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let (config, relay, port) = relay_with_console(
        &outbox,
        &format!("token_file = \"{}\"\n", token_file.display()),
    );
    wait_until_serving(port).await;
    let console_url = format!("http://127.0.0.1:{port}/console/");
    assert!(
        relay
            .log()
            .lines()
            .iter()
            .any(|l| l.contains("serving the console") && l.contains(&console_url)),
        "the start is logged with the console's address: {:?}",
        relay.log().lines()
    );
    let name = outbox.tables.outbox_name();

    // The overview's counts are the CLI's.
    let overview = json_of(port, "/console/api/overview");
    let row = &overview["outboxes"][0];
    assert_eq!(row["name"], json!(name));
    assert_eq!(
        (
            &row["pending"],
            &row["dead_letters"],
            &row["held_aggregates"]
        ),
        (&json!(3), &json!(3), &json!(3)),
        "{row}"
    );
    assert_eq!(overview["writable"], json!(true));
    let stats: Value = serde_json::from_str(&run_ok(&config.path, &["stats", "--json"])).unwrap();
    for key in ["pending", "dead_letters", "held_aggregates"] {
        assert_eq!(
            row[key], stats[key],
            "{key}: console {row} against stats {stats}"
        );
    }

    // The CLI's filters, the error text among them (case-insensitive).
    let matching = json_of(port, "/console/api/dead-letters?error=REFUSED%20BY");
    assert_eq!(matching["outboxes"][0]["total"], json!(3));
    let none = json_of(
        port,
        "/console/api/dead-letters?error=timeout&event_type=payment.refused",
    );
    assert_eq!(none["outboxes"][0]["total"], json!(0));
    // Pages of one outbox, each after the last dead letter of the one before.
    let first = json_of(
        port,
        &format!("/console/api/dead-letters?outbox={name}&limit=2"),
    );
    let after = first["outboxes"][0]["next_after"]
        .as_str()
        .unwrap()
        .to_string();
    let second = json_of(
        port,
        &format!("/console/api/dead-letters?outbox={name}&limit=2&after={after}"),
    );
    let paged: Vec<&Value> = [&first, &second]
        .iter()
        .flat_map(|p| p["outboxes"][0]["letters"].as_array().unwrap())
        .map(|l| &l["id"])
        .collect();
    let expected: Vec<Value> = heads.iter().map(|id| json!(id)).collect();
    assert_eq!(
        paged,
        expected.iter().collect::<Vec<_>>(),
        "every dead letter once, in order"
    );
    assert_eq!(second["outboxes"][0]["next_after"], Value::Null);
    let listed = get(port, "/console/api/dead-letters").unwrap().1;
    assert!(
        !listed.contains("hunter2") && listed.contains("amqp://app:***@mq.internal"),
        "{listed}"
    );

    // Without the token, or with a wrong one, nothing changes.
    let one = json!({ "outbox": name, "ids": [retried] });
    assert_eq!(act(port, "retry", &[], &one).0, 401);
    assert_eq!(act(port, "purge", &[], &one).0, 401);
    let wrong = [("Authorization", "Bearer not-the-token")];
    assert_eq!(act(port, "retry", &wrong, &one).0, 403);
    assert_eq!(act(port, "purge", &wrong, &one).0, 403);
    let cookie = [("Cookie", "token=s3cret-console-token")];
    assert_eq!(
        act(port, "purge", &cookie, &one).0,
        401,
        "a cookie is no token"
    );
    assert_eq!(dead_count(&outbox).await, 3);

    let browser = Browser::start();
    browser.goto(&console_url);
    let cell = |field: &str| format!("tr[data-outbox=\"{name}\"] td[data-field=\"{field}\"]");
    browser.wait_text(&cell("pending"), LIMIT, |t| t == "3");
    assert_eq!(browser.text(&cell("dead_letters")).as_deref(), Some("3"));
    assert_eq!(browser.text(&cell("held_aggregates")).as_deref(), Some("3"));
    assert_eq!(browser.text(&cell("broker")).as_deref(), Some("up"));
    // The chart: a point per sample of the backlog, several seconds of them.
    browser.wait_count("#chart circle.point.backlog", 10, LIMIT);
    browser.wait_count("#chart polyline.backlog", 1, LIMIT);
    browser.screenshot(&docs("console-overview.png"));

    browser.click("#nav-dead-letters");
    browser.wait_count("#letters tbody tr", 3, LIMIT);
    let error_cell = format!("#letters tr[data-id=\"{retried}\"] td[data-field=\"last_error\"]");
    let shown_error = browser.text(&error_cell).unwrap();
    assert!(
        shown_error.contains("<script>alert(2)</script>") && !shown_error.contains("hunter2"),
        "{shown_error}"
    );
    browser.click(&format!("a.inspect[data-id=\"{retried}\"]"));
    let payload = browser.wait_text("#letter-payload", LIMIT, |t| t.contains("alert(1)"));
    assert!(
        payload.starts_with("{\n  \"")
            && payload.contains("\n  \"note\": \"<script>alert(1)</script>\"")
            && payload.contains("\n  \"amount\": 5"),
        "pretty-printed, as text: {payload}"
    );
    assert_eq!(
        browser
            .text("#letter-fields dd[data-field=\"Attempts\"]")
            .as_deref(),
        Some("1")
    );
    assert_eq!(browser.count("script"), 1, "only the console's own script");
    assert_eq!(browser.dialog(), None, "no dialog opened");
    browser.screenshot(&docs("console-dead-letters.png"));

    // Pages: two per page, then the next page of the outbox, then back.
    browser.type_into("input[name=\"limit\"]", "2");
    browser.click("#search");
    browser.wait_text("#letters-count", LIMIT, |t| {
        t.starts_with("2 of 3 dead letters shown")
    });
    browser.click("button.next-page");
    browser.wait_text("#letters-count", LIMIT, |t| t.contains("a later page"));
    assert_eq!(browser.count("#letters tbody tr"), 1);
    assert_eq!(
        browser.count(&format!("#letters tr[data-id=\"{}\"]", heads[2])),
        1
    );
    browser.click("#first-page");
    browser.wait_text("#letters-count", LIMIT, |t| {
        t.starts_with("2 of 3 dead letters shown")
    });

    // Retry one: the dry run counts, the confirmation changes, the relay publishes it.
    browser.type_into("#token", TOKEN);
    browser.click("#token-use");
    browser.click(&format!("input.pick[data-id=\"{retried}\"]"));
    browser.click("#retry");
    browser.wait_text("#confirm-text", LIMIT, |t| {
        t == "Retry (publish again) 1 dead letter(s)?"
    });
    assert_eq!(dead_count(&outbox).await, 3, "the dry run changed nothing");
    browser.click("#confirm-yes");
    browser.wait_text("#status", LIMIT, |t| t == "1 dead letter(s) retried");
    let published = poll(LIMIT, Duration::from_millis(100), async || {
        relay.published_ids().contains(&retried).then_some(())
    })
    .await;
    assert!(published.is_some(), "the retried dead letter was published");
    assert_eq!(dead_count(&outbox).await, 2);

    // Purge another.
    browser.wait_count("#letters tbody tr", 2, LIMIT);
    browser.click(&format!("input.pick[data-id=\"{purged}\"]"));
    browser.click("#purge");
    browser.wait_text("#confirm-text", LIMIT, |t| {
        t == "Purge (delete for good) 1 dead letter(s)?"
    });
    browser.click("#confirm-yes");
    browser.wait_text("#status", LIMIT, |t| t == "1 dead letter(s) purged");
    let events = outbox.tables.events();
    assert!(ids_where(&outbox, events, &format!("id = '{purged}'"))
        .await
        .is_empty());
    assert_eq!(dead_count(&outbox).await, 1);
    assert_eq!(browser.dialog(), None, "no dialog opened");

    // The same audit lines as the CLI's.
    let log = relay.log();
    assert_eq!(log.count("dead letters changed"), 2, "{:?}", log.lines());
    let retried_line = format!("action=\"retry\" outbox={name} selection=ids={retried} affected=1");
    assert_eq!(log.count(&retried_line), 1, "{:?}", log.lines());
    drop(browser);
    let (status, _) = relay.terminate(LIMIT);
    assert!(status.success());
    outbox.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_token_file_the_console_is_read_only_and_off_by_default() {
    let outbox = TestOutbox::new().await.unwrap();
    let heads = dead_heads_with_followers(&outbox, &[("a", json!({}))]).await;
    let (_config, relay, port) = relay_with_console(&outbox, "");
    wait_until_serving(port).await;
    assert_eq!(
        json_of(port, "/console/api/overview")["writable"],
        json!(false)
    );
    let page = get(port, "/console/").unwrap();
    assert_eq!(page.0, 200);
    assert!(page.1.contains("outbox console"));
    let body = json!({ "outbox": outbox.tables.outbox_name(), "ids": [heads[0]] });
    let (status, answer) = act(
        port,
        "purge",
        &[("Authorization", "Bearer anything")],
        &body,
    );
    assert_eq!(status, 403, "{answer}");
    assert!(answer.contains("read-only"), "{answer}");
    assert_eq!(dead_count(&outbox).await, 1);
    relay.terminate(LIMIT);

    let (_config, off, port) = {
        let port = common::free_port();
        let config = Config::for_schema(
            outbox.tables.schema().as_str(),
            &format!("127.0.0.1:{port}"),
        );
        let relay = RelayProcess::start(&config.path);
        (config, relay, port)
    };
    wait_until_serving(port).await;
    assert_eq!(get(port, "/console/").unwrap().0, 404);
    assert_eq!(get(port, "/console/api/overview").unwrap().0, 404);
    off.terminate(LIMIT);
    outbox.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn every_outbox_and_tenant_of_the_process_is_on_the_overview() {
    let orders = TestOutbox::new().await.unwrap();
    let billing = TestOutbox::new().await.unwrap();
    dead_heads_with_followers(&billing, &[("x", json!({}))]).await;
    let prefix = format!("console_{}", Uuid::new_v4().simple());
    let tenant = format!("{prefix}_t1");
    pgoutbox_postgres::migrate(&orders.pool, &Tables::in_schema(&tenant).unwrap())
        .await
        .unwrap();
    let port = common::free_port();
    let config = Config::new(&format!(
        r#"{head}pending_refresh = "200ms"

[[outbox]]
schema = "{orders}"

[[outbox]]
name = "billing"
schema = "{billing}"

[tenants]
schemas = "{prefix}\\_%"
interval = "300ms"

[http]
listen = "127.0.0.1:{port}"

[broker]
kind = "stdout"

[console]
enabled = true
sample_interval = "200ms"
"#,
        head =
            Config::head(&database_url(), "unused").replace("[tables]\nschema = \"unused\"\n", ""),
        orders = orders.tables.schema().as_str(),
        billing = billing.tables.schema().as_str(),
    ));
    let relay = RelayProcess::start(&config.path);
    wait_until_serving(port).await;
    let tenant_name = Tables::in_schema(&tenant).unwrap().outbox_name();
    let rows = poll(LIMIT, Duration::from_millis(100), async || {
        let overview = json_of(port, "/console/api/overview");
        let rows = overview["outboxes"].as_array().cloned().unwrap_or_default();
        (rows.len() == 3).then_some(rows)
    })
    .await
    .expect("three outboxes on the overview");
    let by_name = |name: &str| {
        rows.iter()
            .find(|r| r["name"] == json!(name))
            .unwrap_or_else(|| panic!("{name} is not on the overview: {rows:?}"))
            .clone()
    };
    let first = by_name(&orders.tables.outbox_name());
    assert_eq!(
        (&first["kind"], &first["pending"]),
        (&json!("outbox"), &json!(0))
    );
    let second = by_name("billing");
    assert_eq!(
        (&second["kind"], &second["dead_letters"], &second["pending"]),
        (&json!("outbox"), &json!(1), &json!(1)),
        "{second}"
    );
    assert_eq!(by_name(&tenant_name)["kind"], json!("tenant"));

    // Listing one outbox by name; an unknown one is a clear error.
    let listed = json_of(port, "/console/api/dead-letters?outbox=billing");
    assert_eq!(listed["outboxes"].as_array().unwrap().len(), 1);
    assert_eq!(listed["outboxes"][0]["total"], json!(1));
    let (status, body) = get(port, "/console/api/dead-letters?outbox=nope").unwrap();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("no outbox named `nope`"), "{body}");
    // Each outbox has its history.
    let history = poll(LIMIT, Duration::from_millis(100), async || {
        let history = json_of(port, "/console/api/history");
        let series = history["outboxes"].as_object()?.clone();
        (series.len() == 3
            && series
                .values()
                .all(|s| s.as_array().is_some_and(|p| p.len() >= 2)))
        .then_some(series)
    })
    .await;
    assert!(history.is_some(), "a history per outbox");

    relay.terminate(LIMIT);
    drop_schema(&orders.pool, &tenant).await;
    orders.drop_schema().await.unwrap();
    billing.drop_schema().await.unwrap();
}
