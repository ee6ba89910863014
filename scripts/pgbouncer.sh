#!/usr/bin/env bash
# PgBouncer in transaction pooling mode in front of the test database, for the
# tests that run producers and relays through a pooler (outbox-postgres/tests/pgbouncer.rs).
#
#   source scripts/pgbouncer.sh   # start in the background, export OUTBOX_PGBOUNCER_URL,
#                                 # stop when the sourcing shell exits
#   scripts/pgbouncer.sh cargo test -p pgoutbox-postgres --test pgbouncer
#                                 # start, run the command, stop; exits with its status
#   scripts/pgbouncer.sh          # run in the foreground until Ctrl-C
#
# Port: OUTBOX_PGBOUNCER_PORT (default 6433; not 6432, where a PgBouncer installed as
# a system service listens with a configuration of its own). Its own configuration in
# a temporary folder: trust authentication for the user postgres (the test server
# trusts local logins), every database forwarded to PostgreSQL on 127.0.0.1:5432, and
# 2 server connections per database, fewer than the tests' client connections, so that
# server connections are shared between the transactions of different clients.
# Reuses a PgBouncer already listening on the port if the test database answers
# through it (and then leaves it running). Needs pgbouncer installed (this script
# does not install it; .ci/run does, from Debian's package `pgbouncer`); fails with
# one line on stderr and a non-zero status when it cannot be had.

# shellcheck source=scripts/service.sh
source "$(dirname "${BASH_SOURCE[0]}")/service.sh"

_pgbouncer_fail() {
    echo "pgbouncer.sh: $*" >&2
    return 1
}

_pgbouncer_answers() {
    # Bounded: something else on the port may never answer a PostgreSQL login.
    timeout 5 psql "$1" -Atqc 'SELECT 1' >/dev/null 2>&1
}

# The process, and the folder with its configuration and log.
_pgbouncer_stop() { service_stop PGBOUNCER_PID PGBOUNCER_DIR; }

_pgbouncer_start() {
    local port="${OUTBOX_PGBOUNCER_PORT:-6433}"
    local url="postgres://postgres@127.0.0.1:${port}/test"
    export OUTBOX_PGBOUNCER_URL="$url"
    PGBOUNCER_PID=""
    PGBOUNCER_DIR=""
    if service_port_open "$port"; then
        if _pgbouncer_answers "$url"; then
            echo "pgbouncer.sh: reusing the PgBouncer at $url" >&2
            return 0
        fi
        _pgbouncer_fail "something listens on 127.0.0.1:$port but $url does not answer through it; stop it or set OUTBOX_PGBOUNCER_PORT"
        return 1
    fi
    # Debian installs it in /usr/sbin, which a user's PATH may not hold.
    local bin
    bin="$(command -v pgbouncer || true)"
    if [ -z "$bin" ] && [ -x /usr/sbin/pgbouncer ]; then bin=/usr/sbin/pgbouncer; fi
    if [ -z "$bin" ]; then
        _pgbouncer_fail "pgbouncer is not installed; install it (Debian, Ubuntu: apt-get install pgbouncer; macOS: brew install pgbouncer)"
        return 1
    fi
    PGBOUNCER_DIR="$(mktemp -d "${TMPDIR:-/tmp}/outbox-pgbouncer.XXXXXX")"
    # PgBouncer refuses to run as root: as root, it drops to another user, who must
    # be able to read its files.
    chmod 755 "$PGBOUNCER_DIR"
    local as_user=()
    if [ "$(id -u)" = 0 ]; then
        if id postgres >/dev/null 2>&1; then as_user=(-u postgres); else as_user=(-u nobody); fi
    fi
    echo '"postgres" ""' >"$PGBOUNCER_DIR/users.txt"
    cat >"$PGBOUNCER_DIR/pgbouncer.ini" <<EOF
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $PGBOUNCER_DIR/users.txt
pool_mode = transaction
default_pool_size = 2
max_client_conn = 200
EOF
    chmod 644 "$PGBOUNCER_DIR"/*
    local log="$PGBOUNCER_DIR/pgbouncer.log"
    "$bin" "${as_user[@]}" "$PGBOUNCER_DIR/pgbouncer.ini" >"$log" 2>&1 &
    PGBOUNCER_PID=$!
    service_await PGBOUNCER_PID 10 "$log" _pgbouncer_stop _pgbouncer_answers "$url" \
        || { _pgbouncer_fail "PgBouncer does not answer at $url (its log: $SERVICE_LOG_TAIL)"; return 1; }
    echo "pgbouncer.sh: PgBouncer (pid $PGBOUNCER_PID) answers at $url" >&2
}

service_run pgbouncer.sh _pgbouncer_start _pgbouncer_stop PGBOUNCER_PID OUTBOX_PGBOUNCER_URL "$@"
