#!/usr/bin/env bash
# The test CA of the TLS tests: a CA and a server certificate it signs for
# 127.0.0.1 and localhost, made with openssl in OUTBOX_TLS_DIR (default
# /var/lib/outbox-test-ca) when missing or expiring within a day. Exports
# OUTBOX_TLS_CA, OUTBOX_TLS_SERVER_CERT and OUTBOX_TLS_SERVER_KEY (readable by
# the user running it only). Test servers present the certificate (PostgreSQL via
# scripts/pg-tls.sh; the NATS tests start a nats-server of their own with it);
# clients trust the CA.
#
#   source scripts/test-ca.sh

_test_ca_setup() {
    local dir="${OUTBOX_TLS_DIR:-/var/lib/outbox-test-ca}"
    command -v openssl >/dev/null || { echo "test-ca.sh: openssl is not installed" >&2; return 1; }
    mkdir -p "$dir" || { echo "test-ca.sh: cannot create $dir" >&2; return 1; }
    if [ ! -s "$dir/server.crt" ] || [ ! -s "$dir/server.key" ] || [ ! -s "$dir/ca.crt" ] \
        || ! openssl x509 -checkend 86400 -noout -in "$dir/server.crt" >/dev/null 2>&1; then
        echo "test-ca.sh: making a test CA and a server certificate in $dir" >&2
        (
            set -e
            cd "$dir"
            umask 077
            openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=outbox test CA" \
                -keyout ca.key -out ca.crt 2>/dev/null
            openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
                -keyout server.key -out server.csr 2>/dev/null
            printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n' > server.ext
            openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
                -days 3650 -extfile server.ext -out server.crt 2>/dev/null
            rm -f server.csr server.ext
            chmod 644 ca.crt server.crt
        ) || { echo "test-ca.sh: openssl could not make the certificates in $dir" >&2; return 1; }
    fi
    export OUTBOX_TLS_CA="$dir/ca.crt"
    export OUTBOX_TLS_SERVER_CERT="$dir/server.crt"
    export OUTBOX_TLS_SERVER_KEY="$dir/server.key"
}

_test_ca_setup
