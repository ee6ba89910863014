#!/usr/bin/env bash
# PostgreSQL over TLS for the TLS tests (outbox-postgres/tests/tls.rs and the
# binary's): makes sure the local server
# - presents the test server certificate of scripts/test-ca.sh (for 127.0.0.1 and
#   localhost; a copy owned by postgres in OUTBOX_PG_TLS_DIR, default
#   /var/lib/postgresql/outbox-tls), set with ALTER SYSTEM (ssl_cert_file,
#   ssl_key_file, ssl = on) and a configuration reload;
# - has a role `outbox_tls` with a password that may log in from 127.0.0.1 only
#   over TLS (two lines at the top of pg_hba.conf: hostssl scram-sha-256, then
#   reject), with CREATE on the test database;
# and exports OUTBOX_PG_TLS_USER and OUTBOX_PG_TLS_PASSWORD_FILE (the password, in
# a file as a secret is mounted), besides test-ca.sh's OUTBOX_TLS_* variables.
#
#   source scripts/pg-tls.sh      # as scripts/test.sh does
#
# Needs psql and superuser access to the server at DATABASE_URL (the
# test server trusts local logins), and write access to pg_hba.conf (root or
# postgres). Changes nothing for other clients: sslmode=prefer clients could use
# TLS before (Debian's default configuration has ssl = on) and still can.

_pg_tls_fail() {
    echo "pg-tls.sh: $*" >&2
    return 1
}

_pg_tls_setup() {
    local url="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
    local dir="${OUTBOX_PG_TLS_DIR:-/var/lib/postgresql/outbox-tls}"
    local sql=(psql "$url" -v ON_ERROR_STOP=1 -Atq)
    mkdir -p "$dir" || { _pg_tls_fail "cannot create $dir"; return 1; }

    # The test CA and the server certificate (scripts/test-ca.sh).
    # shellcheck source=scripts/test-ca.sh
    source "$(dirname "${BASH_SOURCE[0]}")/test-ca.sh" || return 1
    # The server reads its key as its own OS user and refuses a key others can read:
    # PostgreSQL gets its own copy.
    install -o postgres -g postgres -m 600 "$OUTBOX_TLS_SERVER_KEY" "$dir/pg-server.key" \
        && install -o postgres -g postgres -m 644 "$OUTBOX_TLS_SERVER_CERT" "$dir/pg-server.crt" \
        || { _pg_tls_fail "cannot install the server certificate for PostgreSQL in $dir"; return 1; }

    local current
    current=$("${sql[@]}" -c "SHOW ssl_cert_file") || { _pg_tls_fail "cannot query PostgreSQL at $url"; return 1; }
    if [ "$current" != "$dir/pg-server.crt" ] || [ "$("${sql[@]}" -c "SHOW ssl")" != "on" ]; then
        echo "pg-tls.sh: PostgreSQL now presents $dir/pg-server.crt (ALTER SYSTEM, reload)" >&2
        "${sql[@]}" -c "ALTER SYSTEM SET ssl_cert_file = '$dir/pg-server.crt'" \
            -c "ALTER SYSTEM SET ssl_key_file = '$dir/pg-server.key'" \
            -c "ALTER SYSTEM SET ssl = on" >/dev/null \
            || { _pg_tls_fail "cannot configure TLS on the server"; return 1; }
    fi
    # Always: the certificate files may be new (test-ca.sh renews them).
    "${sql[@]}" -c "SELECT pg_reload_conf()" >/dev/null || { _pg_tls_fail "cannot reload the server's configuration"; return 1; }

    # The TLS-only role and its password file.
    if [ ! -s "$dir/password" ]; then
        (umask 077; openssl rand -hex 16 > "$dir/password")
    fi
    local password
    password=$(cat "$dir/password")
    "${sql[@]}" <<SQL >/dev/null || { _pg_tls_fail "cannot create the role outbox_tls"; return 1; }
DO \$\$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_tls') THEN
        CREATE ROLE outbox_tls LOGIN;
    END IF;
END \$\$;
SET password_encryption = 'scram-sha-256';
ALTER ROLE outbox_tls PASSWORD '$password';
GRANT CREATE ON DATABASE test TO outbox_tls;
SQL
    local hba
    hba=$("${sql[@]}" -c "SHOW hba_file") || return 1
    if ! grep -q '^hostssl all outbox_tls 127.0.0.1/32 scram-sha-256' "$hba"; then
        echo "pg-tls.sh: $hba: role outbox_tls logs in only over TLS, with its password" >&2
        local tmp
        tmp=$(mktemp) || return 1
        {
            echo "# outbox tests (scripts/pg-tls.sh): the role outbox_tls logs in only over TLS"
            echo "hostssl all outbox_tls 127.0.0.1/32 scram-sha-256"
            echo "host    all outbox_tls 127.0.0.1/32 reject"
            cat "$hba"
        } > "$tmp" && cat "$tmp" > "$hba" && rm -f "$tmp" \
            || { _pg_tls_fail "cannot write $hba"; return 1; }
        "${sql[@]}" -c "SELECT pg_reload_conf()" >/dev/null || return 1
    fi

    # The server may take a moment to load the reloaded files: wait for a TLS login.
    local i
    for i in $(seq 50); do
        if PGPASSWORD="$password" psql "postgres://outbox_tls@127.0.0.1:5432/test?sslmode=verify-full&sslrootcert=$OUTBOX_TLS_CA" \
            -Atqc 'SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()' 2>/dev/null | grep -qx t; then
            export OUTBOX_PG_TLS_USER=outbox_tls
            export OUTBOX_PG_TLS_PASSWORD_FILE="$dir/password"
            echo "pg-tls.sh: PostgreSQL answers over TLS (verify-full) as outbox_tls" >&2
            return 0
        fi
        sleep 0.2
    done
    _pg_tls_fail "no TLS login as outbox_tls with sslmode=verify-full and the test CA"
}

_pg_tls_setup
