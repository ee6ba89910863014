//! Shares of a backlog: relays draining one outbox claim disjoint aggregates
//! instead of walking each other's rows, and a relay whose share ran dry claims
//! everything again (`src/shares.rs`).

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::fill;
use pgoutbox_core::{Claim, Store};
use pgoutbox_postgres::testing::TestOutbox;
use pgoutbox_postgres::PgStore;
use uuid::Uuid;

/// The share (of `count`) an aggregate belongs to: its lock key modulo `count`.
async fn share_of(db: &TestOutbox, aggregate_type: &str, aggregate_id: &str, count: i32) -> i32 {
    sqlx::query_scalar("SELECT (hashtext($1 || ' ' || $2) & 2147483647) % $3")
        .bind(aggregate_type)
        .bind(aggregate_id)
        .bind(count)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// The shares of the aggregates in `claim`.
async fn shares_in(db: &TestOutbox, claim: &impl Claim, count: i32) -> HashSet<i32> {
    let mut shares = HashSet::new();
    for e in claim.events() {
        shares.insert(share_of(db, &e.aggregate_type, &e.aggregate_id, count).await);
    }
    shares
}

async fn relays_rows(db: &TestOutbox) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.outbox_events_relays",
        db.tables.schema().quoted()
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// An outbox holding 40 aggregates x 25 events (the ids returned in insertion
/// order), and two relays on it that have found each other and each take a share
/// of two.
async fn two_sharing_relays() -> (TestOutbox, Vec<Uuid>, PgStore, PgStore) {
    let db = TestOutbox::new().await.unwrap();
    let ids = fill(&db, 40, 25).await;
    // The backlog's aggregates fall in both shares of two (hashes of fixed names).
    let mut all = HashSet::new();
    for n in 0..40 {
        all.insert(share_of(&db, "order", &format!("a{n}"), 2).await);
    }
    assert_eq!(all.len(), 2, "the test's aggregates span both shares");
    let (a, b) = (db.store(), db.store());
    until_both_share(&a, &b).await;
    (db, ids, a, b)
}

/// Claim full batches with `a` and `b` in turn (each released) until both take a
/// share of two: each records itself while its claims come back full, and learns
/// of the other at its next renewal (every 250 ms). At most 30 s.
async fn until_both_share(a: &PgStore, b: &PgStore) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (sa, sb) = (a.share(), b.share());
        if let (Some((ia, 2)), Some((ib, 2))) = (sa, sb) {
            assert_ne!(ia, ib, "two relays in one place");
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no shares after 30 s: {sa:?}, {sb:?}"
        );
        for store in [a, b] {
            store.claim(20).await.unwrap().release().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn relays_draining_a_backlog_claim_disjoint_shares() {
    let (db, _, a, b) = two_sharing_relays().await;
    // Both claims open at once, as two relays' are.
    let claim_a = a.claim(20).await.unwrap();
    let claim_b = b.claim(20).await.unwrap();
    assert_eq!(claim_a.events().len(), 20, "a full batch from a's share");
    assert_eq!(claim_b.events().len(), 20, "a full batch from b's share");
    let (share_a, share_b) = (a.share().unwrap().0, b.share().unwrap().0);
    assert_eq!(shares_in(&db, &claim_a, 2).await, HashSet::from([share_a]));
    assert_eq!(shares_in(&db, &claim_b, 2).await, HashSet::from([share_b]));
    assert_eq!(relays_rows(&db).await, 2);
    claim_a.release().await.unwrap();
    claim_b.release().await.unwrap();
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn a_relay_whose_share_ran_dry_claims_everything_again() {
    let (db, ids, _a, b) = two_sharing_relays().await;
    let share_b = b.share().unwrap().0;

    // Twice the backlog: b gets its share's events only, not half of what it asked
    // for, and no more share.
    let claim = b.claim(ids.len() * 2).await.unwrap();
    assert!(!claim.events().is_empty() && claim.events().len() < ids.len());
    assert_eq!(shares_in(&db, &claim, 2).await, HashSet::from([share_b]));
    claim.release().await.unwrap();
    assert_eq!(
        b.share(),
        None,
        "a claim less than half full ends the share"
    );

    // The next claim leaves the relays table and takes every aggregate.
    let claim = b.claim(ids.len() * 2).await.unwrap();
    assert_eq!(claim.events().len(), ids.len());
    assert_eq!(shares_in(&db, &claim, 2).await, HashSet::from([0, 1]));
    assert_eq!(relays_rows(&db).await, 1, "b's row is gone, a's stays");
    claim.release().await.unwrap();
    db.drop_schema().await.unwrap();
}

/// A relay that stops claiming without leaving (it died) keeps its row until it expires;
/// then the relay left takes the whole backlog again, although its claims stay full.
#[tokio::test]
async fn the_share_of_a_relay_that_stopped_returns_once_its_row_expires() {
    let (db, ids, a, b) = two_sharing_relays().await;
    drop(a);
    // b alone: full claims of its share until a's row is older than 2 s.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while b.share().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b still claims a share 30 s after a stopped"
        );
        let claim = b.claim(20).await.unwrap();
        assert_eq!(claim.events().len(), 20);
        claim.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let claim = b.claim(ids.len()).await.unwrap();
    assert_eq!(shares_in(&db, &claim, 2).await, HashSet::from([0, 1]));
    claim.release().await.unwrap();
    db.drop_schema().await.unwrap();
}

/// A relay that stops cleanly (`Relay::run` returned) deletes its row at once:
/// the relay left takes the whole backlog at its next renewal, not 2 s later.
#[tokio::test]
async fn a_relay_that_stops_cleanly_leaves_its_share_at_once() {
    let (db, ids, a, b) = two_sharing_relays().await;
    assert_eq!(relays_rows(&db).await, 2);
    a.stopped().await;
    assert_eq!(relays_rows(&db).await, 1, "a's row is gone");
    // b's next renewal (due 250 ms after its last) finds it alone.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let claim = b.claim(ids.len()).await.unwrap();
    assert_eq!(b.share(), None, "b alone claims without a share");
    assert_eq!(shares_in(&db, &claim, 2).await, HashSet::from([0, 1]));
    claim.release().await.unwrap();
    db.drop_schema().await.unwrap();
}

/// Shares are a hint: on an outbox without the relays table (migration 6 not
/// applied), full claims go on without a share.
#[tokio::test]
async fn without_the_relays_table_claims_go_on_without_a_share() {
    let db = TestOutbox::new().await.unwrap();
    fill(&db, 40, 25).await;
    sqlx::query(&format!(
        "DROP TABLE {}.outbox_events_relays",
        db.tables.schema().quoted()
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let store = db.store();
    for _ in 0..3 {
        let claim = store.claim(20).await.unwrap();
        assert_eq!(claim.events().len(), 20);
        claim.release().await.unwrap();
        assert_eq!(store.share(), None);
    }
    db.drop_schema().await.unwrap();
}
