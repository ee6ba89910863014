#!/usr/bin/env bash
# PostgreSQL restart drill: restarts the local PostgreSQL cluster under a running
# `outbox relay` and live producers, then checks that nothing was lost, counts
# duplicates, checks per-aggregate order and prints how long the relay took to
# publish again. It restarts the server: never run it next to the test suite.
#
#   scripts/pg-restart-drill.sh            # needs root (pg_ctlcluster) and a built binary
#
# Environment: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test),
# OUTBOX_BIN (default $CARGO_TARGET_DIR/debug/outbox, else target/debug/outbox).
set -euo pipefail
cd "$(dirname "$0")/.."

db="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
bin="${OUTBOX_BIN:-${CARGO_TARGET_DIR:-target}/debug/outbox}"
schema=outbox_restart_drill
aggregates=50
work=$(mktemp -d)
say() { printf 'drill: %s\n' "$*" >&2; }
sql() { psql "$db" -XAtq -v ON_ERROR_STOP=1 -c "$1"; }
now_ms() { date +%s%3N; }

[ -x "$bin" ] || { say "no outbox binary at $bin (cargo build -p pgoutbox-relay, or set OUTBOX_BIN)"; exit 1; }
cluster=$(ls /etc/postgresql)

producer_pid=
relay_pid=
cleanup() {
    touch "$work/stop"
    [ -n "$producer_pid" ] && wait "$producer_pid" 2>/dev/null || true
    [ -n "$relay_pid" ] && kill "$relay_pid" 2>/dev/null || true
    wait 2>/dev/null || true
    sql "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

export OUTBOX_DATABASE_URL="$db?application_name=outbox-drill"
export OUTBOX_SCHEMA=$schema OUTBOX_BROKER=stdout OUTBOX_RETENTION=1d OUTBOX_HTTP_LISTEN=0
sql "SET client_min_messages = warning; DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null
"$bin" migrate >/dev/null
events="$schema.outbox_events"

# The relay: one process with 2 claim loops; the stdout broker writes one JSON line
# per publish, so the file holds every publish in order.
OUTBOX_WORKERS=2 "$bin" relay >"$work/published.jsonl" 2>"$work/relay.log" &
relay_pid=$!

# Producers: one event per transaction over $aggregates aggregates. A
# session lost to the restart ends psql; the loop starts a new one (events of a
# failed transaction were never committed, so they are not expected). They stop
# when the file `stop` appears.
produce() {
    local n=0
    while [ ! -e "$work/stop" ]; do
        {
            while [ ! -e "$work/stop" ]; do
                n=$((n + 1))
                echo "INSERT INTO $events (id, aggregate_type, aggregate_id, event_type, payload)
                      VALUES (gen_random_uuid(), 'order', 'o$((n % aggregates))', 'drill', '{\"n\": $n}');"
                sleep 0.002
            done
        } | psql "$db" -Xq >/dev/null 2>&1 || true
        sleep 0.05
    done
}
produce &
producer_pid=$!

sleep 5
say "restarting PostgreSQL $cluster/main"
before=$(now_ms)
pg_ctlcluster --skip-systemctl-redirect "$cluster" main restart
until pg_isready -q -h 127.0.0.1 -p 5432; do sleep 0.05; done
accepting=$(now_ms)
accepting_sql=$(sql "SELECT to_timestamp($accepting / 1000.0)")
say "restart took $((accepting - before)) ms until PostgreSQL accepted connections"

sleep 10
touch "$work/stop"
wait "$producer_pid" 2>/dev/null || true
producer_pid=
stopped=$(now_ms)

# Wait (bounded) for the relay to publish everything committed.
for _ in $(seq 300); do
    pending=$(sql "SELECT count(*) FROM $events WHERE processed_at IS NULL AND dead_at IS NULL")
    [ "$pending" = 0 ] && break
    sleep 0.1
done
drained=$(now_ms)
kill -TERM "$relay_pid"; wait "$relay_pid" || true; relay_pid=

committed=$(sql "SELECT count(*) FROM $events")
dead=$(sql "SELECT count(*) FROM $events WHERE dead_at IS NOT NULL")
first_after=$(sql "SELECT round(extract(epoch FROM min(processed_at) - '$accepting_sql'::timestamptz) * 1000)
                   FROM $events WHERE processed_at > '$accepting_sql'")
lag_after=$(sql "SELECT round(extract(epoch FROM max(processed_at - created_at)) * 1000)
                 FROM $events WHERE created_at > '$accepting_sql'")
sql "SELECT id, aggregate_id, seq FROM $events ORDER BY seq" >"$work/committed.txt"

ok=0
python3 - "$work/committed.txt" "$work/published.jsonl" <<'EOF' || ok=$?
import json, sys
committed = [line.split("|") for line in open(sys.argv[1]).read().split()]
seq = {i: int(s) for i, _, s in committed}
published, first = [], {}
for line in open(sys.argv[2]):
    e = json.loads(line)
    published.append(e["id"])
    first.setdefault(e["id"], (e["aggregate_id"], len(first)))
lost = [i for i in seq if i not in first]
unknown = [i for i in first if i not in seq]
by_aggregate = {}
for i, (agg, _) in sorted(first.items(), key=lambda kv: kv[1][1]):
    by_aggregate.setdefault(agg, []).append(seq.get(i, -1))
out_of_order = [a for a, s in by_aggregate.items() if s != sorted(s)]
print(f"drill: committed {len(seq)}, published {len(published)} "
      f"({len(published) - len(first)} repeats), lost {len(lost)}, unknown {len(unknown)}, "
      f"aggregates out of order {len(out_of_order)}", file=sys.stderr)
sys.exit(1 if lost or unknown or out_of_order else 0)
EOF
say "first publish recorded $first_after ms after PostgreSQL accepted connections"
say "largest commit-to-publish lag of events committed after the restart: $lag_after ms"
say "backlog drained $((drained - stopped)) ms after producers stopped; dead letters: $dead; events committed: $committed"
say "relay log lines mentioning the database: $(grep -ci 'database\|postgres\|connection' "$work/relay.log" || true)"
grep -i 'error\|warn' "$work/relay.log" | cut -c1-300 | head -8 >&2 || true
exit $ok
