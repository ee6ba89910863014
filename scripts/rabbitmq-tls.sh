#!/usr/bin/env bash
# A TLS listener of the local RabbitMQ on 127.0.0.1:5671 presenting the test
# server certificate of scripts/test-ca.sh, for outbox-amqp/tests/tls.rs. When
# the broker lacks it: a copy of the certificate and key readable by the rabbitmq
# user (in OUTBOX_AMQP_TLS_DIR, default /var/lib/rabbitmq/outbox-tls), the listener
# and certificate lines appended to the broker's rabbitmq.conf, and a restart of
# the broker (rabbitmqctl stop, rabbitmq-server -detached; 10-20 s), waiting for
# both 5672 and 5671. Exports OUTBOX_AMQPS_URL.
#
#   source scripts/rabbitmq-tls.sh   # as scripts/test.sh does
#
# Needs root (or the rabbitmq user) to write the broker's configuration.

# shellcheck source=scripts/service.sh
source "$(dirname "${BASH_SOURCE[0]}")/service.sh"

_rabbitmq_tls_fail() {
    echo "rabbitmq-tls.sh: $*" >&2
    return 1
}

_rabbitmq_tls_setup() {
    local conf="${RABBITMQ_CONFIG_FILE:-/etc/rabbitmq/rabbitmq.conf}"
    conf="${conf%.conf}.conf"
    local dir="${OUTBOX_AMQP_TLS_DIR:-/var/lib/rabbitmq/outbox-tls}"
    # shellcheck source=scripts/test-ca.sh
    source "$(dirname "${BASH_SOURCE[0]}")/test-ca.sh" || return 1
    mkdir -p "$dir" || { _rabbitmq_tls_fail "cannot create $dir"; return 1; }
    local owner=rabbitmq
    id "$owner" >/dev/null 2>&1 || owner=$(id -un)
    local changed=""
    # The broker reads the files as its own user; a renewed certificate needs a restart.
    if ! cmp -s "$OUTBOX_TLS_SERVER_CERT" "$dir/server.crt"; then changed=1; fi
    install -o "$owner" -m 600 "$OUTBOX_TLS_SERVER_KEY" "$dir/server.key" \
        && install -o "$owner" -m 644 "$OUTBOX_TLS_SERVER_CERT" "$dir/server.crt" \
        && install -o "$owner" -m 644 "$OUTBOX_TLS_CA" "$dir/ca.crt" \
        || { _rabbitmq_tls_fail "cannot install the certificates in $dir"; return 1; }
    if ! grep -q '^listeners.ssl.outbox_test = 127.0.0.1:5671' "$conf" 2>/dev/null; then
        echo "rabbitmq-tls.sh: $conf: a TLS listener on 127.0.0.1:5671 for the TLS tests" >&2
        {
            echo "# outbox tests (scripts/rabbitmq-tls.sh): TLS listener with the test CA's certificate"
            echo "listeners.ssl.outbox_test = 127.0.0.1:5671"
            echo "ssl_options.cacertfile = $dir/ca.crt"
            echo "ssl_options.certfile = $dir/server.crt"
            echo "ssl_options.keyfile = $dir/server.key"
            echo "ssl_options.verify = verify_none"
            echo "ssl_options.fail_if_no_peer_cert = false"
        } >> "$conf" || { _rabbitmq_tls_fail "cannot write $conf"; return 1; }
        changed=1
    fi
    if [ -n "$changed" ] || ! service_port_open 5671; then
        echo "rabbitmq-tls.sh: restarting RabbitMQ to load its TLS listener" >&2
        rabbitmqctl stop >/dev/null 2>&1 || true
        local i
        for i in $(seq 60); do service_port_open 5672 || break; sleep 0.5; done
        rabbitmq-server -detached >/dev/null 2>&1 || true
        for i in $(seq 120); do
            if service_port_open 5672 && service_port_open 5671; then break; fi
            sleep 0.5
        done
        service_port_open 5671 || { _rabbitmq_tls_fail "RabbitMQ does not listen on 127.0.0.1:5671 after a restart (see its log)"; return 1; }
        # The AMQP port opens before the broker accepts logins: wait for one.
        for i in $(seq 60); do
            rabbitmqctl await_startup >/dev/null 2>&1 && break
            sleep 0.5
        done
    fi
    export OUTBOX_AMQPS_URL="amqps://guest:guest@127.0.0.1:5671/%2f"
}

_rabbitmq_tls_setup
