#!/usr/bin/env bash
# The whole test suite: makes sure every service the tests talk to is running
# (starting what it can), then runs `cargo test` over the workspace with every
# feature. A service that cannot be had is a clear failure, never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."

export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
export OUTBOX_NATS_URL="${OUTBOX_NATS_URL:-nats://127.0.0.1:4222}"
export OUTBOX_AMQP_URL="${OUTBOX_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"

say() { printf 'test.sh: %s\n' "$*" >&2; }

# service_port_open PORT: something listens on 127.0.0.1:PORT.
# shellcheck source=scripts/service.sh
source scripts/service.sh

# need NAME PORT START_COMMAND: start NAME when its port is closed, wait up to 60 s.
need() {
    local name=$1 port=$2 start=$3
    if service_port_open "$port"; then return 0; fi
    say "$name is not listening on 127.0.0.1:$port; starting it: $start"
    bash -c "$start" >/dev/null 2>&1 || true
    for _ in $(seq 60); do
        if service_port_open "$port"; then say "$name is up"; return 0; fi
        sleep 1
    done
    say "FAILED: $name is not reachable on 127.0.0.1:$port (tried: $start)"
    exit 1
}

need PostgreSQL 5432 'pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start'
need RabbitMQ 5672 'rabbitmq-server -detached'
need NATS 4222 'start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log'
if ! psql "$DATABASE_URL" -Atqc 'select 1' >/dev/null 2>&1; then
    say "FAILED: cannot log in to $DATABASE_URL"
    exit 1
fi

# The WAL outbox reads a logical replication slot, which needs wal_level = logical:
# a server restart. ALTER SYSTEM keeps it, so this happens once per machine.
wal_level=$(psql "$DATABASE_URL" -Atqc 'SHOW wal_level')
if [ "$wal_level" != logical ]; then
    say "PostgreSQL has wal_level = $wal_level; the WAL outbox tests need logical: ALTER SYSTEM SET wal_level = logical, restarting PostgreSQL"
    psql "$DATABASE_URL" -Atqc 'ALTER SYSTEM SET wal_level = logical' >/dev/null
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main restart
    for _ in $(seq 60); do
        if psql "$DATABASE_URL" -Atqc 'select 1' >/dev/null 2>&1; then break; fi
        sleep 1
    done
    wal_level=$(psql "$DATABASE_URL" -Atqc 'SHOW wal_level' 2>/dev/null || true)
    if [ "$wal_level" != logical ]; then
        say "FAILED: PostgreSQL did not come back with wal_level = logical (it says: ${wal_level:-nothing})"
        exit 1
    fi
    say "PostgreSQL restarted with wal_level = logical"
fi

# SQS: moto's server, installed (pip) and started by scripts/moto.sh, which
# exports OUTBOX_SQS_ENDPOINT and stops the server when this script exits.
# Kafka: most tests start librdkafka's mock cluster themselves; the conformance
# suite and an end-to-end test also run against tansu, a Kafka-protocol broker
# process that scripts/tansu.sh installs when missing (cargo install, once per
# machine, 15-25 min), starts, exports as OUTBOX_TANSU_BROKERS and stops at exit.
# shellcheck source=scripts/moto.sh
source scripts/moto.sh || { say "FAILED: moto (SQS test server) could not be started"; exit 1; }
# shellcheck source=scripts/tansu.sh
source scripts/tansu.sh || { say "FAILED: tansu (Kafka test broker) could not be started (see above)"; exit 1; }

# PgBouncer in transaction pooling mode, for the tests through a pooler: started by
# scripts/pgbouncer.sh (pgbouncer must be installed), which exports
# OUTBOX_PGBOUNCER_URL and stops it when this script exits.
# shellcheck source=scripts/pgbouncer.sh
source scripts/pgbouncer.sh || { say "FAILED: PgBouncer could not be started (see above)"; exit 1; }

# PostgreSQL over TLS: a test CA and server certificate, and a role that logs in
# only over TLS; scripts/pg-tls.sh exports OUTBOX_PG_TLS_USER and _PASSWORD_FILE, and (from
# scripts/test-ca.sh) OUTBOX_TLS_CA, OUTBOX_TLS_SERVER_CERT, OUTBOX_TLS_SERVER_KEY.
# shellcheck source=scripts/pg-tls.sh
source scripts/pg-tls.sh || { say "FAILED: PostgreSQL over TLS could not be set up (see above)"; exit 1; }

# RabbitMQ's TLS listener on 127.0.0.1:5671 (restarts the broker once to add it);
# scripts/rabbitmq-tls.sh exports OUTBOX_AMQPS_URL.
# shellcheck source=scripts/rabbitmq-tls.sh
source scripts/rabbitmq-tls.sh || { say "FAILED: RabbitMQ's TLS listener could not be set up (see above)"; exit 1; }

# Go (Debian's golang-go) with lib/pq and nats.go, for the example service written in
# Go (examples/go-orders, run by outbox-relay/tests/go_orders.rs); scripts/go.sh
# installs the Debian packages when missing and exports OUTBOX_GO and OUTBOX_GOPATH.
# shellcheck source=scripts/go.sh
source scripts/go.sh || { say "FAILED: Go and its PostgreSQL and NATS libraries could not be installed (see above)"; exit 1; }

# Headless Chromium and chromedriver (Debian's chromium and chromium-driver), for
# the console's browser tests (outbox-relay/tests/console.rs); scripts/chromium.sh
# installs them when missing, starts chromedriver, exports OUTBOX_WEBDRIVER_URL and
# stops it when this script exits.
# shellcheck source=scripts/chromium.sh
source scripts/chromium.sh || { say "FAILED: headless Chromium and chromedriver could not be had (see above)"; exit 1; }

cargo test --workspace --all-features "$@"
