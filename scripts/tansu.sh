#!/usr/bin/env bash
# tansu, a Kafka-protocol broker process (Rust, Apache-2.0, in-memory storage), for
# the Kafka tests that run against a real broker (outbox-kafka/tests/conformance.rs).
#
#   source scripts/tansu.sh        # start in the background, export OUTBOX_TANSU_BROKERS,
#                                  # stop when the sourcing shell exits
#   scripts/tansu.sh cargo test -p pgoutbox-kafka --test conformance
#                                  # start, run the command, stop; exits with its status
#   scripts/tansu.sh               # run in the foreground until Ctrl-C
#
# Installs tansu when it is missing: `cargo install tansu` (a pinned version, with
# the `dynostore` feature that its in-memory storage needs) into OUTBOX_TOOLS_DIR
# (default /var/cache/outbox-tools, outside the clone, so CI runs reuse it). The
# first install builds about 800 crates: 15-25 minutes on 2 cores, once per machine.
# Port: OUTBOX_TANSU_PORT (default 19092, not Kafka's 9092).

# shellcheck source=scripts/service.sh
source "$(dirname "${BASH_SOURCE[0]}")/service.sh"

TANSU_VERSION=0.6.0

_tansu_fail() {
    echo "tansu.sh: $*" >&2
    return 1
}

# The process, and its log.
_tansu_stop() { service_stop TANSU_PID TANSU_LOG; }

_tansu_start() {
    local port="${OUTBOX_TANSU_PORT:-19092}"
    export OUTBOX_TANSU_BROKERS="127.0.0.1:$port"
    TANSU_PID=""
    TANSU_LOG=""
    if service_port_open "$port"; then
        _tansu_fail "something already listens on 127.0.0.1:$port; stop it or set OUTBOX_TANSU_PORT"
        return 1
    fi
    local tools="${OUTBOX_TOOLS_DIR:-/var/cache/outbox-tools}"
    local bin="$tools/bin/tansu"
    if [ ! -x "$bin" ] || ! "$bin" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
        echo "tansu.sh: installing tansu $TANSU_VERSION into $tools (first time on this machine: 15-25 min)" >&2
        mkdir -p "$tools" || { _tansu_fail "cannot create $tools"; return 1; }
        CARGO_TARGET_DIR="$tools/target" cargo install tansu --version "$TANSU_VERSION" \
            --locked --features dynostore --root "$tools" --quiet \
            || { _tansu_fail "cargo install tansu failed (see above)"; return 1; }
    fi
    TANSU_LOG="$(mktemp "${TMPDIR:-/tmp}/outbox-tansu.XXXXXX")"
    "$bin" broker --listener-url "tcp://127.0.0.1:$port" \
        --advertised-listener-url "tcp://127.0.0.1:$port" \
        --storage-engine memory://tansu/ >"$TANSU_LOG" 2>&1 &
    TANSU_PID=$!
    service_await TANSU_PID 20 "$TANSU_LOG" _tansu_stop service_port_open "$port" \
        || { _tansu_fail "tansu does not listen on 127.0.0.1:$port (its log: $SERVICE_LOG_TAIL)"; return 1; }
    echo "tansu.sh: tansu (pid $TANSU_PID) listens on $OUTBOX_TANSU_BROKERS" >&2
}

service_run tansu.sh _tansu_start _tansu_stop TANSU_PID OUTBOX_TANSU_BROKERS "$@"
